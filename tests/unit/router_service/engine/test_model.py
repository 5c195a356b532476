"""MoeModel: a pass gives the same logits wherever its experts run, reports what its remote
layers cost, bounds every expert call by the batch's (the sequences') deadline, and lets another
micro-batch compute while its expert calls are out."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.checkpoint import Checkpoint
from common.sampling import SamplingParams
from router_service.build import build_model
from router_service.engine.compute import ComputeThread
from router_service.engine.engine import Engine
from router_service.engine.model import MoeModel, pack_step
from router_service.engine.pipeline import PassCosts
from router_service.experts.backends import ColocatedExperts
from router_service.experts.dispatch import ExpertDispatcher
from router_service.settings import RouterSettings
from tests.support.backends import FakeClock, Recording

BLOCK = 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint) -> Checkpoint:
    return Checkpoint(checkpoint("mixtral"))


def prefill(tokens: list[int]):
    return pack_step([(list(range(8)), 0, tokens)], [], BLOCK)


def logits_of(model: MoeModel, tokens: list[int], costs: PassCosts) -> torch.Tensor:
    async def run() -> torch.Tensor:
        return await model.forward(prefill(tokens), model.new_cache(16, BLOCK), costs=costs)

    try:
        return asyncio.run(run())
    finally:
        model.close()


def test_a_pass_gives_the_same_logits_with_its_experts_here_or_remote(ckpt) -> None:
    # Both on as many threads (the recording backend computes on the event loop's), so that the
    # float sums are the same to the bit.
    settings = RouterSettings(checkpoint=ckpt.path, max_model_len=64, serial_max_tokens=0)
    weights = ckpt.load_experts(ckpt.all_expert_pairs())
    remote = Recording(weights, service_s=0.002)
    tokens = [5, 9, 11, 3, 7]
    here, there = PassCosts(), PassCosts()
    want = logits_of(build_model(ckpt, settings), tokens, here)
    got = logits_of(build_model(ckpt, settings, {p: [remote] for p in weights}), tokens, there)
    assert torch.equal(got, want) and want.shape == (1, ckpt.spec.vocab_size)
    moe_layers = len(ckpt.spec.moe_layer_ids)
    assert here.remote == [] and here.moe_layers == there.moe_layers == moe_layers
    assert [t.service for t in there.remote] == [0.002] * moe_layers
    assert len({layer for layer, _ in remote.served}) == moe_layers
    assert here.compute_s > 0 and there.compute_s > 0


def remote_model(ckpt, clock: FakeClock) -> tuple[MoeModel, Recording]:
    weights = ckpt.load_experts(ckpt.all_expert_pairs())
    remote = Recording(weights)
    dispatcher = ExpertDispatcher(ckpt.spec, {p: [remote] for p in weights}, clock=clock)
    return MoeModel(ckpt.spec, ckpt.load_dense(), dispatcher, 64), remote


def test_the_batch_deadline_bounds_every_expert_call(ckpt) -> None:
    clock = FakeClock()
    model, remote = remote_model(ckpt, clock)
    batch = prefill([5, 9, 11])
    batch.deadline = clock() + 3.0
    asyncio.run(model.forward(batch, model.new_cache(16, BLOCK)))
    assert remote.timeouts == [pytest.approx(3.0)] * len(ckpt.spec.moe_layer_ids)


@pytest.mark.parametrize(
    "deadlines, timeout_s",
    [((3.0, 5.0), 5.0), ((3.0, None), 30.0)],  # 30: the dispatcher's default per-call timeout
)
def test_a_sequence_deadline_reaches_its_expert_calls(ckpt, deadlines, timeout_s) -> None:
    """Calls serve every sequence of the micro-batch: they may run until its latest deadline, and
    without one when a sequence has none."""
    clock = FakeClock()
    model, remote = remote_model(ckpt, clock)
    engine = Engine(model, RouterSettings(checkpoint=ckpt.path, micro_batches="1"))
    for i, left in enumerate(deadlines):
        deadline = None if left is None else clock() + left
        engine.add_request(str(i), [5 + i, 9, 11], GREEDY, deadline=deadline)
    asyncio.run(engine.step())
    assert remote.timeouts == [pytest.approx(timeout_s)] * len(ckpt.spec.moe_layer_ids)


class Paired(ColocatedExperts):
    """Remote-looking experts that answer a call only once another call is in flight with it."""

    local = False

    def __init__(self, weights) -> None:
        super().__init__(weights)
        self.barrier = asyncio.Barrier(2)

    async def forward(self, layer, groups, timeout_s=None):
        await self.barrier.wait()
        return self.compute(layer, groups)


def test_a_pass_computes_while_another_waits_for_its_experts(ckpt) -> None:
    """Two passes on one compute thread: each expert call is answered only while the other
    pass's call for that layer is out too, so they finish only if one pass computes its next
    layers while the other waits (the micro-batch ping-pong)."""
    weights = ckpt.load_experts(ckpt.all_expert_pairs())
    compute = ComputeThread()
    paired = Paired(weights)
    dispatcher = ExpertDispatcher(ckpt.spec, {p: [paired] for p in weights})
    model = MoeModel(ckpt.spec, ckpt.load_dense(), dispatcher, 64, compute)
    local = ColocatedExperts(weights)
    colocated = ExpertDispatcher(ckpt.spec, {p: [local] for p in weights})
    reference = MoeModel(ckpt.spec, ckpt.load_dense(), colocated, 64)

    async def both() -> list[torch.Tensor]:
        passes = (model.forward(prefill(t), model.new_cache(16, BLOCK)) for t in ([5, 9], [7]))
        return await asyncio.wait_for(asyncio.gather(*passes), 10)

    async def alone(tokens: list[int]) -> torch.Tensor:
        return await reference.forward(prefill(tokens), reference.new_cache(16, BLOCK))

    try:
        got = asyncio.run(both())
    finally:
        model.close()
    assert torch.equal(got[0], asyncio.run(alone([5, 9])))
    assert torch.equal(got[1], asyncio.run(alone([7])))
