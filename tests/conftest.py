"""Shared fixtures: checkpoints are created once per session and reused across tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_mesh.common import runtime

runtime.configure()  # the test process is a router too: before anything imports torch
from tests.support.factories import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path) -> Callable[..., Path]:
    """checkpoint(arch, preset="tiny", **create_kwargs) -> directory, cached for the session."""

    def make(arch: str, preset: str = "tiny", **kwargs) -> Path:
        return make_checkpoint(checkpoint_root, arch, preset, **kwargs)

    return make


def run(coro):
    """Run a coroutine to completion from a synchronous test."""
    return asyncio.run(coro)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests (the small preset, generation at length) are left out of the quick run too."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.e2e)
