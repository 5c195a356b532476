"""The gateway: the public gRPC (moe_mesh.v1.Inference) and OpenAI-compatible HTTP edge in front of
router replicas. Built on common/ and protos/ only."""
