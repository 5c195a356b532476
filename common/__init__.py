"""Code every moe-mesh service shares: specs, checkpoint reading, the gating and expert math, errors."""
