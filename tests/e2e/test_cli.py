"""The `moe-mesh` command line, run as a user would: a subprocess of the installed console script."""

from __future__ import annotations

import json

import pytest

from moe_mesh.common.tokenizer import Tokenizer
from tests.support.cli import moe_mesh

pytestmark = pytest.mark.e2e  # the `moe-mesh` command in subprocesses


def test_generate_local_json_with_token_ids(checkpoint) -> None:
    path = checkpoint("olmoe")
    r = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt-token-ids",
        "11,3,250,9",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert out["text"] == Tokenizer(path).decode(out["token_ids"])


def test_generate_local_streams_text_for_a_prompt(checkpoint) -> None:
    path = checkpoint("mixtral")
    streamed = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt",
        "Hello wörld",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    as_json = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt",
        "Hello wörld",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"]
    assert "[length] 6 tokens" in streamed.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "max_tokens: must be >= 1"),
        (["--max-tokens", "100000"], "max_tokens: prompt (2 tokens) + max_tokens (100000) exceeds"),
        (["--top-p", "0"], "top_p: must be in (0, 1]"),
        (["--temperature", "-1"], "temperature: must be a finite number >= 0"),
    ],
)
def test_generate_bad_input_exits_2_naming_the_field(checkpoint, args, message) -> None:
    r = moe_mesh(
        "generate",
        "--checkpoint",
        checkpoint("mixtral"),
        "--local",
        "--prompt-token-ids",
        "1,2",
        *args,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_generate_needs_exactly_one_prompt_source(checkpoint) -> None:
    both = moe_mesh(
        "generate",
        "--checkpoint",
        checkpoint("mixtral"),
        "--local",
        "--prompt",
        "x",
        "--prompt-token-ids",
        "1",
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    bad_ids = moe_mesh(
        "generate", "--checkpoint", checkpoint("mixtral"), "--local", "--prompt-token-ids", "1,x"
    )
    assert bad_ids.returncode == 2 and "comma-separated integers" in bad_ids.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path) -> None:
    r = moe_mesh("generate", "--checkpoint", tmp_path / "nope", "--local", "--prompt", "x")
    assert r.returncode == 2 and "checkpoint directory not found" in r.stderr and "nope" in r.stderr
