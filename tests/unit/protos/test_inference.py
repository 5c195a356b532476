"""The public Inference contract (inference.proto): field presence and a round trip."""

from __future__ import annotations

from protos.moe_mesh.v1 import inference_pb2


def test_public_request_fields() -> None:
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
