"""Developer tools: random-initialised checkpoints (`moe-mesh create-checkpoint`) and protobuf codegen
(`make protos`)."""
