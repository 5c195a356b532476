"""Operating a running mesh: `moe-mesh status`, `placement show`, `stats` and `trace show`."""
