"""Integration tests: several components in one process, over real gRPC and HTTP servers on port 0."""
