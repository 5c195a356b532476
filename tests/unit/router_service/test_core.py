"""router_service/core.py: RouterCore streams each request's tokens from the engine it steps, aborts
a request its caller leaves, refuses an id in flight without disturbing its holder, reports status,
and supervises its loop (deaths counted within a window, on a fake clock; a device error ends it at
once)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.errors import AlreadyExistsError, InternalError, UnavailableError
from common.sampling import SamplingParams
from router_service.build import build_router
from router_service.core import RouterCore
from router_service.engine import engine as engine_module
from router_service.engine.engine import FinishReason
from router_service.settings import RouterSettings
from tests.support.polling import eventually
from tests.support.reference import PROMPTS, monolithic

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture
def path(checkpoint):
    return checkpoint("mixtral")


@pytest.fixture
async def make_core(path):
    """make_core(**kwargs) -> a started RouterCore over a monolithic engine; stopped at the end."""
    cores: list[RouterCore] = []

    async def make(**kwargs) -> RouterCore:
        parts = await build_router(RouterSettings(checkpoint=path))
        core = RouterCore(parts.engine, "m", parts.tierer, **kwargs)
        core.start()
        cores.append(core)
        return core

    yield make
    for core in cores:
        await core.stop()
        core.engine.close()


async def tokens(core: RouterCore, rid: str, prompt: list[int], params=GREEDY):
    """Every token of one request and the finish reason of its last output."""
    outs = [o async for o in core.generate(rid, prompt, params)]
    assert all(o.finish_reason is None for o in outs[:-1])
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


async def test_requests_batched_together_get_the_monolithic_engines_tokens(make_core, path) -> None:
    core = await make_core()
    results = await asyncio.gather(*(tokens(core, f"r{i}", p) for i, p in enumerate(PROMPTS)))
    for i, (got, reason) in enumerate(results):
        assert (got, reason) == (list(monolithic(path)[i][:8]), FinishReason.LENGTH), i
    status = core.status()
    assert (status.model_id, status.running, status.waiting) == ("m", 0, 0)
    assert 8 <= status.steps == core.steps <= 8 * len(PROMPTS)
    assert sum(map(sum, status.tokens_routed)) > 0  # every expert colocated, and used
    assert set(status.placement) == {"colocated"}


async def test_a_caller_leaving_aborts_its_request_and_others_are_served(make_core, path) -> None:
    core = await make_core()
    stream = core.generate("left", PROMPTS[2], LONG)
    first = await anext(stream)
    assert first.new_token_ids and core.status().running == 1
    await stream.aclose()
    await eventually(lambda: not core.engine.has_unfinished(), 10, "the abort")
    assert core.status().running == 0
    assert await tokens(core, "next", PROMPTS[1]) == (
        list(monolithic(path)[1][:8]),
        FinishReason.LENGTH,
    )


async def test_an_id_in_flight_is_refused_and_its_holder_runs_on(make_core, path) -> None:
    core = await make_core()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    holder = core.generate("same", PROMPTS[1], params)
    got = list((await anext(holder)).new_token_ids)
    with pytest.raises(AlreadyExistsError):
        await tokens(core, "same", PROMPTS[0])
    async for out in holder:
        got += out.new_token_ids
    assert got == list(monolithic(path)[1][:24])


async def test_the_loop_gives_up_after_max_deaths_within_the_window(make_core) -> None:
    now = [0.0]
    reasons: list[str] = []

    async def unhealthy(reason: str) -> None:
        reasons.append(reason)

    core = await make_core(
        on_unhealthy=unhealthy, max_loop_deaths=2, loop_death_window_s=60, clock=lambda: now[0]
    )

    async def broken_step():
        raise RuntimeError("a bug in the step")

    core.engine.step = broken_step
    for at in (0.0, 100.0):  # two deaths, but further apart than the window: it restarts
        now[0] = at
        with pytest.raises(InternalError, match="engine loop failed.*a bug in the step"):
            await tokens(core, f"at{at:g}", PROMPTS[0])
        assert core.down is None
    now[0] = 130.0  # the second death within 60 s of the one before
    with pytest.raises(InternalError):
        await tokens(core, "third", PROMPTS[0])
    await eventually(lambda: reasons, 5, "the report")
    assert core.loop_deaths == 3 and core.down is not None
    assert reasons == [core.down] and "died 2 times within 60s" in core.down
    with pytest.raises(UnavailableError, match="stopped serving"):
        await tokens(core, "after", PROMPTS[0])


@pytest.mark.parametrize("where", ["pass", "sampling"])
async def test_a_device_error_stops_serving_at_once(make_core, monkeypatch, where) -> None:
    """A CUDA error outlives its call (every later one on the device fails too), so the first one
    ends the loop for good, wherever it shows first (on a GPU the host first waits for the
    device in the pass or in sampling), where a plain bug fails only its requests."""
    reasons: list[str] = []

    async def unhealthy(reason: str) -> None:
        reasons.append(reason)

    core = await make_core(on_unhealthy=unhealthy, max_loop_deaths=3)
    failure = [RuntimeError("a bug in this micro-batch")]
    real_forward, real_sample = core.engine.model.forward, engine_module.sample

    async def failing(*args, **kwargs):
        if failure:
            raise failure[0]
        return await real_forward(*args, **kwargs)

    def failing_sample(*args):
        if failure:
            raise failure[0]
        return real_sample(*args)

    if where == "pass":
        core.engine.model.forward = failing
    else:
        monkeypatch.setattr(engine_module, "sample", failing_sample)
    with pytest.raises(InternalError, match="a bug in this micro-batch"):
        await tokens(core, "bug", PROMPTS[0])
    failure.clear()
    assert (await tokens(core, "next", PROMPTS[0]))[1] is FinishReason.LENGTH
    assert core.down is None and core.loop_deaths == 0

    failure.append(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    with pytest.raises(InternalError, match="engine loop failed.*device-side assert"):
        await tokens(core, "lost", PROMPTS[0])
    await eventually(lambda: reasons, 5, "the report")
    assert core.loop_deaths == 1 and reasons == [core.down]
    assert "device failed" in core.down and "new process" in core.down
    with pytest.raises(UnavailableError, match="stopped serving.*device failed"):
        await tokens(core, "after", PROMPTS[0])
