"""A float32 decode step of one sequence as one kernel call (engine/fused_f32.py): the op-by-op
path's bits (and so transformers' tokens) in Mixtral's and Qwen3's families, trusted only once
its first step matched op by op, dropped where it did not, bursts with the tokens of single
steps, and op by op wherever it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch

from common import float32
from common.sampling import SamplingParams
from router_service import build
from router_service.build import build_local_engine
from router_service.engine import fused_f32
from router_service.settings import RouterSettings
from tests.support.engine_runs import decode, run
from tests.support.factories import realigned

pytestmark = pytest.mark.skipif(
    float32.torch_lanes() is None,
    reason="torch's vector width here is neither AVX2's nor AVX-512's",
)
# Where the kernel was seen to repeat torch to the bit: torch's AVX2 kernels (host B) and its
# AVX-512 ones (host C). Elsewhere the first step's check decides, and these tests ask only that
# the answers are op by op's either way.
CHECKED_HERE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def model(path, one_call: bool = True, dtype: str = "float32"):
    s = RouterSettings(checkpoint=path, dtype=dtype, max_model_len=64)
    m = build.build_model(build._open(s), s)
    if not one_call:
        m.fused = None
    return m


@pytest.fixture
def kernel():
    if fused_f32.bf16.kernel("moe_decode_step_f32") is None:
        pytest.skip("no C compiler or no AVX2 here: no one-call float32 step")


# Besides the tiny presets: sums long enough for the cascade's carries (hidden 1024), shorter
# than a vector (6 of 8 experts' weights), and SiLU's scalar tail (an expert width of 72).
WIDE = {"hidden_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 6}


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("mixtral", {}),
        ("qwen3_moe", {}),
        ("mixtral", {**WIDE, "intermediate_size": 72}),
        ("qwen3_moe", {**WIDE, "num_experts": 8, "moe_intermediate_size": 72}),
    ],
)
def test_a_float32_step_in_one_call_gives_the_op_by_op_bits(
    kernel, checkpoint, arch, overrides, caplog
):
    path = checkpoint(arch, overrides=overrides) if overrides else checkpoint(arch)
    one, op_by_op = model(path), model(path, one_call=False)
    assert isinstance(one.fused, fused_f32.FusedDecodeF32), fused_f32.unfit(one.spec, one.weights)
    assert not one.fused.trusted
    with caplog.at_level(logging.INFO, logger="router_service.engine.model"):
        got, calls = decode(one, 8)
    want, _ = decode(op_by_op, 8)
    assert len(got) == 8 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].dtype == torch.float32 and got[0].shape == (1, one.spec.vocab_size)
    if CHECKED_HERE or one.fused is not None:
        assert calls == 8 and one.fused.trusted and "run as one kernel call" in caplog.text
    else:
        assert calls == 1 and "decoding op by op" in caplog.text
    # The first step, computed both ways to be checked, is counted once.
    a, b = one.dispatcher, op_by_op.dispatcher
    assert a.routed_counts() == b.routed_counts()
    assert a.tokens_colocated == b.tokens_colocated > 0


def test_gate_and_up_kept_apart_as_stored_decode_in_one_call_with_the_op_by_op_bits(
    kernel, checkpoint, tmp_path
):
    """A checkpoint whose tensors lie as new tensors would keeps Mixtral's gate and up apart
    (checkpoint.py, float32.halves_agree): the one-call step takes them as they are."""
    path = realigned(checkpoint("mixtral"), tmp_path / "aligned")
    one, op_by_op = model(path), model(path, one_call=False)
    got, calls = decode(one, 8)
    want, _ = decode(op_by_op, 8)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if CHECKED_HERE:
        assert calls == 8 and one.fused.trusted
        assert all(f.up is not None for f in one.fused._experts.values())
        assert one.fused.model.up  # the step points at the ups apart


def test_a_step_that_differs_from_op_by_op_is_dropped_and_never_answers(kernel, checkpoint, caplog):
    path = checkpoint("mixtral")
    one, op_by_op = model(path), model(path, one_call=False)
    run_step = one.fused._run

    def off_by_a_bit(*args):  # as a torch whose sums or exp this kernel does not repeat
        logits = run_step(*args)
        logits[0, 0] = torch.nextafter(logits[0, 0], torch.tensor(float("inf")))
        return logits

    one.fused._run = off_by_a_bit
    with caplog.at_level(logging.WARNING, logger="router_service.engine.model"):
        got, calls = decode(one, 3)
    want, _ = decode(op_by_op, 3)
    assert calls == 1 and one.fused is None and "decoding op by op" in caplog.text
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_several_sequences_and_other_models_decode_op_by_op(kernel, checkpoint):
    m = model(checkpoint("mixtral"))
    got, calls = decode(m, 3, sequences=3)
    want, _ = decode(model(checkpoint("mixtral"), one_call=False), 3, sequences=3)
    assert calls == 0 and all(torch.equal(g, w) for g, w in zip(got, want))
    shared = model(checkpoint("qwen2_moe"))
    assert shared.fused is None
    assert fused_f32.unfit(shared.spec, shared.weights) == "a dense layer or shared experts"
    bf = model(checkpoint("mixtral"), dtype="bfloat16")
    assert fused_f32.unfit(bf.spec, bf.weights) == "not float32 on the CPU"
    bf.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_float32_bursts_give_the_tokens_of_op_by_op_steps(kernel, checkpoint, arch, monkeypatch):
    def engine():
        settings = RouterSettings(
            checkpoint=checkpoint(arch),
            dtype="float32",
            max_model_len=64,
            kv_block_size=4,
            decode_burst=8,
            decode_burst_ms=0,
        )
        return build_local_engine(settings)

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    bursting = engine()
    got, steps = run(bursting, {"r": params}, close=False)
    trusted = bursting.model.fused is not None
    bursting.close()
    monkeypatch.setenv("MOE_MESH_FUSED_DECODE", "off")
    want, _ = run(engine(), {"r": params})
    assert got == want and len(want["r"][0]) == 20
    assert trusted or not CHECKED_HERE
    # The prefill's token, a single step checked against op by op, then bursts.
    assert [s["r"] for s in steps] == ([1, 1, 8, 8, 2] if trusted else [1] * 20)
