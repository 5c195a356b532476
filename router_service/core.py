"""The router's serving loop, free of gRPC: one task steps the engine while requests stream out.

Each request gets a queue of StepOutputs; leaving `generate` early (client cancelled, deadline
passed) aborts the request, which frees its batch slot and KV cache at the next token boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router_service.engine import Engine, FinishReason, StepOutput
from router_service.sampling import SamplingParams


@dataclass
class RouterStatus:
    model_id: str
    running: int
    waiting: int
    steps: int
    tokens_routed: list[list[int]]  # [layers][experts]
    failovers: int
    placement: dict[str, list[tuple[int, int]]]  # "colocated" or address -> pairs it serves
    registry_stale: bool  # running on the last known membership: the registry is unreachable


class RouterCore:
    def __init__(self, engine: Engine, model_id: str) -> None:
        self.engine = engine
        self.model_id = model_id
        self.membership = None  # set when expert services come from a registry
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> RouterStatus:
        dispatcher = self.engine.model.dispatcher
        placement: dict[str, list[tuple[int, int]]] = {}
        for pair, replicas in sorted(dispatcher.placement.items()):
            for backend in replicas:
                placement.setdefault("colocated" if backend.local else backend.address, []).append(pair)
        return RouterStatus(self.model_id, len(self.engine.running), self.engine.num_waiting, self.steps,
                            dispatcher.tokens_routed.tolist(), dispatcher.failovers, placement,
                            bool(self.membership is not None and self.membership.stale))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, deadline: float | None = None) -> AsyncIterator[StepOutput]:
        """Stream a request's outputs; the last one has a finish_reason. Raises the step's error on failure."""
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.engine.add_request(request_id, prompt_token_ids, params, priority, deadline)
        self._queues[request_id] = queue
        self._work.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)
                self._work.set()

    async def _loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self.engine.has_unfinished():
                outputs = await self.engine.step()
                self.steps += 1
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None and out.finish_reason is not FinishReason.CANCELLED:
                        queue.put_nowait(out)
                # Let the server read new requests and flush streamed tokens between steps.
                await asyncio.sleep(0)
