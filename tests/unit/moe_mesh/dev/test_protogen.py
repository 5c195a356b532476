"""The committed generated code is exactly what `make protos` produces."""

from __future__ import annotations

from pathlib import Path

from moe_mesh.dev.protogen import PROTO_DIR, REPO_ROOT, generate


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    committed = sorted((REPO_ROOT / PROTO_DIR).glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, c in zip(fresh, committed) if p.read_bytes() != c.read_bytes()]
    assert not stale, f"regenerate with `make protos`: {stale} differ"


def test_public_request_fields() -> None:
    from moe_mesh.protos.moe_mesh.v1 import inference_pb2

    req = inference_pb2.GenerateRequest(
        prompt="hi",
        max_tokens=4,
        temperature=0.0,
        top_p=0.9,
        top_k=5,
        seed=7,
        stop=["\n"],
        priority=2,
    )
    assert req.HasField("prompt") and req.HasField("temperature") and not req.prompt_token_ids
    both = inference_pb2.GenerateRequest(prompt="", prompt_token_ids=[1, 2])
    assert both.HasField(
        "prompt"
    )  # presence survives an empty prompt, so "both given" is detectable
    resp = inference_pb2.GenerateResponse(
        request_id="r",
        token_ids=[1],
        text="a",
        finish_reason=1,
        usage=inference_pb2.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    assert inference_pb2.GenerateResponse.FromString(resp.SerializeToString()) == resp
