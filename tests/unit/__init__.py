"""Unit tests: `unit/<package>/` holds the tests of that package's modules, in one process."""
