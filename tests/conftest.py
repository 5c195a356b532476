"""Shared fixtures (checkpoints created once per session, tiny health-only gRPC servers, a port
that refuses connections) and the `e2e` marker, set by folder."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from common import runtime

# The test process is a router too, next to the expert services it starts: before torch loads.
runtime.configure(shares_cores=True)
from common.server import GrpcServer  # noqa: E402
from tests.support.factories import make_checkpoint  # noqa: E402
from tests.support.net import bound_port  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path) -> Callable[..., Path]:
    """checkpoint(arch, preset="tiny", **create_kwargs) -> directory, cached for the session."""

    def make(arch: str, preset: str = "tiny", **kwargs) -> Path:
        return make_checkpoint(checkpoint_root, arch, preset, **kwargs)

    return make


@pytest.fixture
async def grpc_servers() -> AsyncIterator[Callable[[], Awaitable[GrpcServer]]]:
    """Factory of tiny real gRPC servers (health service only) on loopback port 0."""
    servers: list[GrpcServer] = []

    async def make() -> GrpcServer:
        server = GrpcServer([], grace_s=0.1)
        await server.start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        await s.stop()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections for the whole test, which the other pytest
    worker's services cannot take meanwhile."""
    with bound_port() as port:
        yield port


E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ is `e2e`, and nothing else: where a test lives says how it runs.

    A test marked `e2e` or `slow` by hand outside that folder belongs in it, so it is refused here
    rather than quietly joining (or leaving) the quick run.
    """
    misplaced = []
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.e2e)
        elif any(item.iter_markers("e2e")) or any(item.iter_markers("slow")):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "marked e2e or slow but not under tests/e2e/: " + ", ".join(misplaced)
        )
