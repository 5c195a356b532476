"""bench/gpu_support.py: a part's result is on disk after every record (what a part stopped at its
time bound leaves), and the first divergence of two sets of continuations is found."""

from __future__ import annotations

import json
import time

from bench.gpu_support import Context, first_divergence


def test_record_writes_the_result_as_it_grows(tmp_path) -> None:
    path = tmp_path / "part.json"
    ctx = Context("cpu", tmp_path, time.monotonic() + 30, path)
    ctx.record("families", {"mixtral": {"float32": {"token_exact": True}}})
    assert json.loads(path.read_text()) == {
        "families": {"mixtral": {"float32": {"token_exact": True}}}
    }
    ctx.record("ok", False)
    assert json.loads(path.read_text())["ok"] is False
    assert not list(tmp_path.glob("*.partial"))
    assert 0 < ctx.left_s() <= 30


def test_record_without_a_file_keeps_the_result_in_memory(tmp_path) -> None:
    ctx = Context("cpu", tmp_path, time.monotonic())
    ctx.record("x", 1)
    assert ctx.result == {"x": 1} and list(tmp_path.iterdir()) == []


def test_first_divergence() -> None:
    assert first_divergence([[1, 2], [3]], [[1, 2], [3]]) is None
    assert first_divergence([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == {
        "prompt": 1, "step": 1, "ours": 4, "transformers": 9,
    }  # fmt: skip
    assert first_divergence([[1, 2]], [[1]]) == {"prompt": 0, "step": 1, "lengths": [2, 1]}
