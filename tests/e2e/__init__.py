"""End-to-end tests: service processes, the `moe-mesh` command, a Node client, or long runs.
Everything here is marked `e2e` by tests/conftest.py; `pytest -m "not e2e"` leaves it out."""
