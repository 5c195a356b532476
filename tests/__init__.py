"""The test suite, laid out like the code (see docs/development/layout.md):

unit/         one package at a time, in process; `unit/<package>/` mirrors the package's folder
integration/  several components in one process: real gRPC and HTTP servers on port 0
e2e/          several processes (services, the `moe-mesh` command, Node) or long runs; marked `e2e`
support/      what tests and `bench/` share, imported as `tests.support`
"""
