"""`moe-mesh scale`'s guard: which experts a scale-down would leave with no replica (counting the
expert services kept and what each router colocates), the refusal naming them, and the control
endpoint's reply to it."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.arch import load_spec
from moe_mesh.local.scaling import OnlyCopyError, check_copies, control, unserved_after


@pytest.fixture(scope="module")
def spec(checkpoint):
    return load_spec(checkpoint("mixtral"))  # 8 experts in every layer


def test_an_expert_is_unserved_only_when_no_kept_service_and_no_router_holds_it(spec) -> None:
    every = [(layer, e) for layer in spec.moe_layer_ids for e in range(8)]
    assert unserved_after(spec, ["*:0-3", "*:4-7"], []) == []
    assert unserved_after(spec, ["*:0-3"], []) == [p for p in every if p[1] >= 4]
    # A router colocating 4-7 holds the only other copy: nothing missing.
    assert unserved_after(spec, ["*:0-3"], ["*:4-7"]) == []
    # ... unless another router does not: a request there would fail, so it counts.
    assert unserved_after(spec, ["*:0-3"], ["*:4-7", ""]) == [p for p in every if p[1] >= 4]
    # Layer by layer: a router colocating layer 0's 4-7 only.
    missing = unserved_after(spec, ["*:0-3"], ["0:4-7"])
    assert missing == [p for p in every if p[1] >= 4 and p[0] != 0]


def test_the_refusal_names_the_experts_and_the_way_out(spec) -> None:
    check_copies(spec, "*:4-7", ["*:0-3", "*:4-7"], [""])  # another replica of 4-7: fine
    with pytest.raises(OnlyCopyError) as e:
        check_copies(spec, "*:4-7", ["*:0-3"], [""])
    assert e.value.missing == "0-2:4-7" and e.value.group == "*:4-7"
    assert "experts 0-2:4-7 would have no replica left" in str(e.value)
    assert "--force" in str(e.value) and "--missing-expert-wait-s" in str(e.value)
    # Experts 4-7 already had no replica: removing 0-3 is refused for 0-3 only.
    with pytest.raises(OnlyCopyError) as e:
        check_copies(spec, "*:0-3", [], [""])
    assert e.value.missing == "0-2:0-3"


async def _ask(request: dict, scale) -> dict:
    server = await asyncio.start_server(lambda r, w: control(r, w, scale), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((json.dumps(request) + "\n").encode())
        reply = json.loads(await reader.readline())
        writer.close()
        return reply
    finally:
        server.close()
        await server.wait_closed()


async def test_the_control_endpoint_passes_force_and_says_what_a_refusal_would_leave() -> None:
    calls = []

    def scale(experts: str, replicas: int, force: bool) -> dict:
        calls.append((experts, replicas, force))
        if not force:
            raise OnlyCopyError(experts, "*:0-1")
        return {"experts": experts, "replicas": replicas, "added": [], "removed": ["a:1"]}

    refused = await _ask({"experts": "*:0-1", "replicas": 0}, scale)
    assert refused["missing"] == "*:0-1" and "no replica left" in refused["error"]
    done = await _ask({"experts": "*:0-1", "replicas": 0, "force": True}, scale)
    assert done["removed"] == ["a:1"]
    assert calls == [("*:0-1", 0, False), ("*:0-1", 0, True)]
    bad = await _ask({"replicas": 0}, scale)  # no experts: an error, not a dead launcher
    assert "error" in bad and "missing" not in bad
