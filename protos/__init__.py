"""Generated protobuf/gRPC code for the moe_mesh.v1 contracts (see `make protos`)."""
