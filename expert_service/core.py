"""The expert service's core: the (layer, expert) pairs it holds, request validation, batched forward.

Knows nothing about gRPC: it takes and returns tensors and raises common.errors, which the servicer
maps to status codes. Every error names the field and what was expected, so a misconfigured router
can be fixed from the message alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.metrics import Observation

from common.arch import ModelSpec
from common.checkpoint import Checkpoint
from common.device import for_experts, resolve
from common.errors import (
    InvalidArgumentError,
    NotFoundError,
    PreconditionError,
    UnavailableError,
)
from common.placement import Pair, format_experts, parse_experts
from common.quant import precision
from common.staging import Stager
from common.telemetry import EXPERT_WEIGHT_BYTES, OFF, Telemetry
from common.weights import FFNWeights
from common.wire import TO_WIRE, dtype_name
from expert_service.batcher import DynamicBatcher
from expert_service.settings import ExpertSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertStats:
    """Counters since start; batches < groups means dynamic batching merged groups of different calls."""

    forward_calls: int
    groups: int
    batches: int
    tokens: int


@dataclass(frozen=True)
class ExpertDescription:
    """What this service holds, so a router can check it serves the same model and weights."""

    model_id: str
    weights_checksum: str
    experts: tuple[Pair, ...]
    dtype: torch.dtype
    hidden_size: int
    region: str
    stats: ExpertStats
    precision: str  # the experts' weights: the dtype, or 'int8' / 'int4-g64' / 'fp8' / 'mxfp4'
    device: str = "cpu"  # where they compute: 'cpu', 'cuda:0', ...


def _dtype_label(dtype: torch.dtype) -> str:
    return dtype_name(TO_WIRE[dtype]) if dtype in TO_WIRE else str(dtype)


# glibc's mallopt parameter, and the ceiling its own dynamic threshold stops at on 64-bit hosts.
_M_MMAP_THRESHOLD = -3
_LOADING_THRESHOLD = 1 << 20
_SERVING_THRESHOLD = 32 << 20


@contextlib.contextmanager
def large_frees_returned() -> Iterator[None]:
    """While loading, blocks of 1 MiB and more are mapped and unmapped on their own, so the
    temporaries a load makes per weight (gate and up joined, then repacked) go back to the OS
    when freed. glibc otherwise serves them from its heap once it has seen one such size freed,
    and the holes they left between the repacked copies stayed resident: 64 of 192 MiB of weights
    (small preset, 16 experts, float32 in oneDNN's layout; AMD EPYC, 2 cores). Afterwards large
    blocks come from the heap up to 32 MiB, where glibc's own threshold would have risen to."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc and musl; not macOS
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _LOADING_THRESHOLD)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, _SERVING_THRESHOLD)


CPU = torch.device("cpu")


class ExpertHost:
    """Holds the FFN weights of the configured (layer, expert) pairs, and nothing else of the model."""

    def __init__(
        self,
        settings: ExpertSettings,
        spec: ModelSpec,
        experts: list[Pair],
        weights: dict[Pair, FFNWeights],
        model_id: str,
        weights_checksum: str,
        telemetry: Telemetry = OFF,
        device: torch.device = CPU,
    ) -> None:
        self.settings, self.device = settings, device
        # What the weights hold: the configured dtype, or the checkpoint's own with "auto".
        self.dtype: torch.dtype = next(iter(weights.values())).down.dtype
        self.spec, self.experts, self.weights = spec, experts, weights
        self.model_id, self.weights_checksum = model_id, weights_checksum
        self.batcher = DynamicBatcher(
            self.weights,
            settings.max_batch_tokens,
            settings.max_queue_delay_us,
            telemetry,
            Stager(device),  # activations arrive and leave in host memory (the wire's)
            self._device_lost,
        )
        self.down: str | None = None  # why this service stopped serving, once its device failed
        self.on_down: list[Callable[[str], None]] = []  # told `down` once (the app: NOT_SERVING)
        self.telemetry = telemetry
        held = [
            Observation(sum(w.nbytes for w in weights.values()), {"moe.precision": self.precision})
        ]
        telemetry.meter.create_observable_gauge(
            EXPERT_WEIGHT_BYTES,
            [lambda _: held],
            description="bytes of the experts' weights held, by moe.precision (int4-g64, ...)",
        )
        self.forward_calls = 0
        self._served: dict[int, set[int]] = {}
        for layer, expert in self.experts:
            self._served.setdefault(layer, set()).add(expert)

    @classmethod
    def load(cls, settings: ExpertSettings, telemetry: Telemetry = OFF) -> ExpertHost:
        """Read the configured pairs from the checkpoint onto the configured device;
        CheckpointError / InvalidArgumentError name what is wrong (`device` a GPU not here)."""
        quantized = settings.quantization is not None
        device = resolve(for_experts(settings.device, quantized))  # before any weight is read
        checkpoint = Checkpoint(
            settings.checkpoint,
            dtype=None if settings.dtype == "auto" else getattr(torch, settings.dtype),
            prepack=True,  # on the CPU only: a CPU layout
            batch_invariant=True,  # the batcher merges callers: rows must not see batch-mates
            quantize=settings.quantization,
            device=device,
        )
        experts = parse_experts(settings.experts, checkpoint.spec)
        with large_frees_returned():
            weights = checkpoint.load_experts(experts)  # only these pairs are read
        return cls(
            settings,
            checkpoint.spec,
            experts,
            weights,
            settings.model_id or checkpoint.path.resolve().name,
            checkpoint.fingerprint(),
            telemetry,
            device,
        )

    def describe(self) -> ExpertDescription:
        s = self.batcher.stats
        return ExpertDescription(
            model_id=self.model_id,
            weights_checksum=self.weights_checksum,
            experts=tuple(self.experts),
            dtype=self.dtype,
            hidden_size=self.spec.hidden_size,
            region=self.settings.region,
            stats=ExpertStats(
                forward_calls=self.forward_calls,
                groups=s.groups,
                batches=s.batches,
                tokens=s.tokens,
            ),
            precision=self.precision,
            device=str(self.device),
        )

    @property
    def precision(self) -> str:
        """What the experts are held in: the dtype, or 'int8' / 'int4-g64' (--quantize), 'fp8' /
        'mxfp4' (the checkpoint's own, computed as published)."""
        down = next(iter(self.weights.values())).down
        return precision(self.dtype, getattr(down, "quantization", None))

    async def forward(
        self,
        model_id: str,
        weights_checksum: str,
        layer: int,
        expert_ids: Sequence[int],
        token_counts: Sequence[int],
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Expert outputs for one layer's token groups, laid out like `hidden`.

        hidden: [sum(token_counts), hidden_size], rows of expert_ids[0] first, then expert_ids[1], ...
        Groups are batched with concurrent calls for the same experts; the result keeps request order.
        """
        self.check_serving()
        self._check_model(model_id, weights_checksum)
        self._check_groups(expert_ids, token_counts)
        self._check_served(layer, expert_ids)
        self._check_hidden(hidden, sum(token_counts))
        self.forward_calls += 1
        span = trace.get_current_span()  # the RPC's server span when this call is traced
        if span.is_recording():
            span.set_attributes(
                {
                    "moe.layer": layer,
                    "moe.experts": list(expert_ids),
                    "moe.expert_tokens": list(token_counts),
                    "moe.tokens": int(hidden.shape[0]),
                    "moe.bytes": hidden.numel() * hidden.element_size(),
                }
            )
        rows = torch.split(hidden, list(token_counts))  # views, one per expert
        outputs = await self.batcher.submit_all(layer, list(zip(expert_ids, rows)))
        return (
            outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        )  # [sum(token_counts), hidden]

    def check_serving(self) -> None:
        """UnavailableError once the device failed: routers fail over, and their health check of
        an ejected replica (Describe) keeps it out."""
        if self.down is not None:
            raise UnavailableError(f"this expert service stopped serving: {self.down}")

    def _device_lost(self, error: BaseException) -> None:
        """A device error outlives its call: every later one would fail too (common.device)."""
        if self.down is None:
            self.down = f"its device failed ({error!r}); only a new process recovers from that"
            for hook in self.on_down:
                try:
                    hook(self.down)
                except Exception:  # the batcher's loop calls this: it must not die of a hook
                    log.exception("could not report the device's failure")

    async def close(self) -> None:
        """Stop the batcher; call after the server has drained its in-flight calls."""
        await self.batcher.close()

    # -- validation ------------------------------------------------------------------------

    def _check_model(self, model_id: str, weights_checksum: str) -> None:
        if model_id != self.model_id:
            raise PreconditionError(f"model_id: expected {self.model_id!r}, got {model_id!r}")
        if weights_checksum != self.weights_checksum:
            raise PreconditionError(
                f"weights_checksum: expected {self.weights_checksum!r}, got {weights_checksum!r}"
                " (router and expert service load different weights)"
            )

    @staticmethod
    def _check_groups(expert_ids: Sequence[int], token_counts: Sequence[int]) -> None:
        if not expert_ids:
            raise InvalidArgumentError(
                "expert_ids", "empty payload; expected at least one expert id"
            )
        if len(token_counts) != len(expert_ids):
            raise InvalidArgumentError(
                "token_counts",
                f"expected one count per expert id ({len(expert_ids)}), got {len(token_counts)}",
            )
        if sum(token_counts) == 0:
            raise InvalidArgumentError("hidden", "empty payload; expected at least one token row")
        for i, (expert, n) in enumerate(zip(expert_ids, token_counts)):
            if n == 0:
                raise InvalidArgumentError(
                    f"token_counts[{i}]", f"expected >= 1 token for expert {expert}, got 0"
                )
        seen: set[int] = set()
        for expert in expert_ids:
            if expert in seen:
                raise InvalidArgumentError(
                    "expert_ids",
                    f"expert {expert} appears more than once; expected each expert once per call",
                )
            seen.add(expert)

    def _check_served(self, layer: int, expert_ids: Sequence[int]) -> None:
        served = self._served.get(layer)
        if served is None:
            raise NotFoundError(
                f"layer {layer}: not served here; this service serves "
                f"{format_experts(self.experts)!r}"
            )
        missing = [e for e in expert_ids if e not in served]
        if missing:
            raise NotFoundError(
                f"layer {layer} expert(s) {', '.join(map(str, missing))}: not served here; "
                f"this service serves {format_experts(self.experts)!r}"
            )

    def _check_hidden(self, hidden: torch.Tensor, tokens: int) -> None:
        limit = self.settings.max_request_tokens
        if tokens > limit:
            raise InvalidArgumentError(
                "hidden", f"sum(token_counts)={tokens} exceeds max_request_tokens={limit}"
            )
        h = self.spec.hidden_size
        if hidden.dim() != 2 or tuple(hidden.shape) != (tokens, h):
            raise InvalidArgumentError(
                "hidden.shape",
                f"expected [sum(token_counts)={tokens}, hidden_size={h}], got {list(hidden.shape)}",
            )
        if hidden.dtype != self.dtype:
            raise InvalidArgumentError(
                "hidden.dtype",
                f"expected {_dtype_label(self.dtype)}, got {_dtype_label(hidden.dtype)}",
            )
        # A NaN/inf row would poison every token batched with it here and come back as garbage.
        # One pass to check: a NaN or inf anywhere makes the sum NaN or inf; only then count them
        # (a sum can also overflow with finite values, which the count then clears).
        if math.isfinite(hidden.sum(dtype=torch.float32).item()):
            return
        bad = int(hidden.numel() - torch.isfinite(hidden).sum())
        if bad:
            raise InvalidArgumentError(
                "hidden",
                f"holds {bad} non-finite value(s) (NaN or inf); expected finite activations",
            )
