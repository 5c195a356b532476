"""A bench's main() run here sets the device variables of bench.CPU_ONLY for its children too;
each test's are undone after it, so no later test of the worker finds them."""

import pytest

from bench import CPU_ONLY


@pytest.fixture(autouse=True)
def _devices_restored(monkeypatch):
    for name in CPU_ONLY:  # setenv records an unset variable for undoing; delenv alone does not
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
