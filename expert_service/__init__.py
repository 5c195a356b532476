"""The expert service: hosts the FFN weights of a set of (layer, expert) pairs and runs batched
expert forward passes for routers (moe_mesh.v1.ExpertService). Built on common/ and protos/ only."""
