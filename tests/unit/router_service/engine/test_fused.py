"""A decode step as one kernel call (engine/fused.py): the op-by-op path's bits and
routing counts in bfloat16 and with int8 and int4 experts (and dense layers), only where every expert is colocated
and the step is decode tokens only, and never for a model the kernel does not take."""

from __future__ import annotations

import asyncio

import pytest
import torch

from router_service import build
from router_service.engine import fused
from router_service.engine.model import MoeModel, pack_step
from router_service.settings import RouterSettings
from tests.support.backends import Recording
from tests.support.engine_runs import BLOCK, decode


def model(path, one_call: bool = True, placement=None, **settings) -> MoeModel:
    s = RouterSettings(checkpoint=path, dtype="bfloat16", max_model_len=64, **settings)
    m = build.build_model(build._open(s), s, placement)
    if not one_call:
        m.fused = None
    return m


@pytest.mark.parametrize(
    "arch, quantize, dense, sequences",
    [
        ("mixtral", "none", False, 1),
        ("qwen3_moe", "none", False, 1),
        ("mixtral", "int8", False, 1),
        ("qwen3_moe", "int4", False, 1),
        ("mixtral", "int4", True, 1),
        ("qwen3_moe", "int8", True, 1),
        ("mixtral", "none", False, 3),
        ("qwen3_moe", "none", False, 5),
        ("mixtral", "int4", True, 4),
        ("qwen3_moe", "none", False, 20),  # attention and LM head on AMX tiles, where they run
    ],
)
def test_a_decode_step_in_one_call_gives_the_op_by_op_bits(
    panels, checkpoint, arch, quantize, dense, sequences
):
    path = checkpoint(arch)
    extra = dict(quantize=quantize, quantize_group_size=32, quantize_dense=dense)
    one, op_by_op = model(path, **extra), model(path, one_call=False, **extra)
    assert one.fused is not None, fused.unfit(one.spec, one.weights)
    got, calls = decode(one, 6, sequences)
    want, _ = decode(op_by_op, 6, sequences)
    assert calls == 6
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == 6
    assert got[0].dtype == torch.float32 and got[0].shape == (sequences, one.spec.vocab_size)
    assert sequences == 1 or not torch.equal(got[0][0], got[0][1])  # each its own sequence
    a, b = one.dispatcher, op_by_op.dispatcher
    assert a.routed_counts() == b.routed_counts()
    assert a.tokens_colocated == b.tokens_colocated > 0


# Widths of 64-column blocks: each thread prepares the inputs it wrote (o's in attention, down's
# beside gate|up); tiny's 96-wide experts do not.
WIDER = dict(
    hidden_size=256,
    moe_intermediate_size=128,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
)


@pytest.mark.parametrize(
    "arch, quantize, sequences, threads, widths",
    [
        ("qwen3_moe", "none", 1, 8, {}),  # 2 query heads of each of 2 KV heads apart; 4 spans
        ("mixtral", "int4", 1, 3, {}),  # KV heads whole, 2 spans
        ("qwen3_moe", "int8", 3, 8, {}),  # KV heads whole, 2 spans a token
        ("qwen3_moe", "int4", 2, 8, {}),  # both tokens' query heads apart; 4 spans a token
        ("qwen3_moe", "none", 1, 2, WIDER),  # gate|up in jobs of 64 columns
        ("qwen3_moe", "int4", 1, 2, WIDER),  # o's and down's inputs prepared where written
        ("qwen3_moe", "int8", 1, 2, WIDER),  # int8's groups of 128
        ("qwen3_moe", "int4", 3, 3, WIDER),  # more experts routed: longer gate|up jobs
        ("qwen3_moe", "int8", 1, 8, WIDER),  # KV heads whole: parts would split o's groups
        ("qwen3_moe", "int4", 2, 8, WIDER),
    ],
)
def test_a_step_on_more_threads_splits_its_work_with_the_bits(
    panels, checkpoint, arch, quantize, sequences, threads, widths
):
    path = checkpoint(arch, **({"overrides": widths} if widths else {}))
    extra = dict(quantize=quantize, quantize_group_size=32, quantize_dense=quantize != "none")
    one, op_by_op = model(path, **extra), model(path, one_call=False, **extra)
    step, ran = one.fused.step, []
    one.fused.step = lambda *args: ran.append(1) or step(*args[:-1], threads)
    got, calls = decode(one, 4, sequences)
    want, _ = decode(op_by_op, 4, sequences)
    assert calls == 4 and len(ran) == 4  # every step in one call
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == 4


def test_a_remote_expert_runs_op_by_op_with_the_same_bits(panels, checkpoint):
    path = checkpoint("mixtral")
    here = model(path)
    weights = {p: w for p, w in here.dispatcher.placement.items()}
    experts = build._open(RouterSettings(checkpoint=path, dtype="bfloat16")).load_experts([(0, 3)])
    remote = {**weights, (0, 3): [Recording(experts)]}  # one expert elsewhere
    got, calls = decode(model(path, placement=remote), 3)
    want, _ = decode(here, 3)
    assert calls == 0 and all(torch.equal(g, w) for g, w in zip(got, want))


def test_models_the_kernel_does_not_take_run_op_by_op(panels, checkpoint, monkeypatch):
    shared = model(checkpoint("qwen2_moe"))
    assert shared.fused is None
    assert fused.unfit(shared.spec, shared.weights) == "a dense layer or shared experts"
    s = RouterSettings(checkpoint=checkpoint("mixtral"), dtype="float32", max_model_len=64)
    assert not isinstance(build.build_model(build._open(s), s).fused, fused.FusedDecode)
    monkeypatch.setenv("MOE_MESH_FUSED_DECODE", "off")
    assert model(checkpoint("mixtral")).fused is None


def test_experts_a_new_placement_moves_away_are_let_go(panels, checkpoint):
    path = checkpoint("mixtral")
    m = model(path)
    experts = m.dispatcher.all_colocated()
    assert m.fused.bind_experts(experts) and m.fused.model.gate_up
    remote = build._open(RouterSettings(checkpoint=path, dtype="bfloat16")).load_experts([(0, 3)])
    m.dispatcher.set_placement({**m.dispatcher.placement, (0, 3): [Recording(remote)]})
    assert m.dispatcher.all_colocated() is None
    _, calls = decode(m, 1)
    # Nothing of the old table held: a demoted expert's weights can be freed.
    assert calls == 0 and m.fused._experts is None and not m.fused.model.gate_up


def test_a_decode_pass_that_cannot_be_one_call_keeps_the_serial_choice(panels, checkpoint):
    m, seen, calls = model(checkpoint("mixtral")), [], []
    m.serial_max_tokens = 32  # decode passes of up to 32 tokens compute on one thread
    layers, step = m._layers, m.fused.step

    async def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return await layers(*args, **kwargs)

    def one_call(*args):
        calls.append(args[-1])
        return step(*args)

    m._layers, m.fused.step = spy, one_call
    threads = torch.get_num_threads()

    async def run():
        cache = m.new_cache(64, BLOCK)
        tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
        await m.forward(pack_step([(t, 0, [5, 9, 11]) for t in tables], [], BLOCK), cache)
        decodes = [(t, 1, 4) for t in tables]
        await m.forward(pack_step([], decodes, BLOCK), cache)  # one call, every thread
        m.dispatcher.traced = lambda: True  # a traced request: op by op, on one thread
        await m.forward(pack_step([], [(t, 1, 5) for t in tables], BLOCK), cache)

    try:
        asyncio.run(run())
    finally:
        m.close()
    assert calls == [threads] and seen[1:] == [1]
