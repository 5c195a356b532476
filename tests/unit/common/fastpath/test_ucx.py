"""common/fastpath/ucx.py's loading of ucxx: without it (the `fastpath` extra not installed) the
services go over gRPC, said once in one log line naming the extra; with it but without RMM,
cuda-bindings, cuda-core or nvidia-ml-py (ucxx-cu12's metadata requires them) it still loads and
moves bytes over TCP."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.fastpath import ucx

ROOT = Path(__file__).resolve().parents[4]
HIDDEN = ("rmm", "librmm", "cuda", "pynvml", "rapids_logger")


def test_without_ucxx_one_log_line_names_the_extra(monkeypatch, caplog) -> None:
    monkeypatch.setattr(ucx, "unavailable", "")
    monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` raises ModuleNotFoundError
    caplog.set_level(logging.WARNING, logger=ucx.__name__)
    assert ucx.load_ucxx(loopback=True) is None
    assert ucx.load_ucxx(loopback=True) is None  # asked again: nothing new to say
    assert ucx.unavailable == (
        "ucxx is not installed (it comes with the fastpath extra: pip install 'moe-mesh[fastpath]')"
    )
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "UCX fast path unavailable (--fast-path auto: activations go over gRPC): " + ucx.unavailable
    ]


def test_a_broken_ucxx_says_what_failed(monkeypatch) -> None:
    monkeypatch.setattr(ucx, "unavailable", "")

    def broken() -> None:
        raise OSError("libucp.so.0: cannot open shared object file")

    monkeypatch.setattr(ucx, "_load_libucx", broken)
    assert ucx.load_ucxx() is None
    assert (
        ucx.unavailable == "ucxx cannot be imported (libucp.so.0: cannot open shared object file)"
    )


PROBE = """
    import asyncio, sys
    import numpy as np
    from common.fastpath import ucx

    ucxx = ucx.load_ucxx(loopback=True)
    assert ucxx is not None, ucx.unavailable
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {HIDDEN!r})
    assert loaded == [], loaded

    async def main():
        async def serve(ep):
            buf = np.empty(1 << 16, dtype=np.uint8)
            await ep.recv(buf)
            await ep.send(buf[::-1].copy())
            await ep.close()

        listener = ucxx.create_listener(serve)
        ep = await ucxx.create_endpoint("127.0.0.1", listener.port)
        msg = (np.arange(1 << 16) % 251).astype(np.uint8)
        back = np.empty_like(msg)
        await ep.send(msg)
        await ep.recv(back)
        assert (back == msg[::-1]).all()
        await ep.close()
        listener.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    print("round trip ok")
"""


@pytest.mark.skipif(ucx.load_ucxx(loopback=True) is None, reason="the fastpath extra is not here")
def test_ucxx_moves_bytes_with_rmm_and_the_cuda_packages_hidden(tmp_path) -> None:
    """A module of each hidden name on the path first raises ModuleNotFoundError, as if not
    installed; ucxx's own loader then skips libucx, and load_ucxx loads it instead."""
    for name in HIDDEN:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('hidden by the test', name={name!r})\n"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    script = textwrap.dedent(PROBE).replace("{HIDDEN!r}", repr(set(HIDDEN)))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "round trip ok" in done.stdout, done.stdout + done.stderr
