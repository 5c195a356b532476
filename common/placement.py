"""Expert specs: which (layer, expert) pairs a process serves, written as text on command lines.

Grammar: items separated by ';', each LAYERS:EXPERTS, each side '*' or a comma list of N or A-B.
  "*:*"            every expert of every MoE layer
  "0-3:0,1"        experts 0 and 1 of layers 0..3
  "*:0-3; 5:7"     experts 0..3 of every MoE layer, plus expert 7 of layer 5
"""

from __future__ import annotations

from dataclasses import dataclass

from common.arch import ModelSpec
from common.errors import InvalidArgumentError

Pair = tuple[int, int]


@dataclass(frozen=True)
class ModelShape:
    """What parse_experts reads of a ModelSpec, for tools that know a model only by its sizes
    (plans, status records); without `layers`, every layer is a MoE layer."""

    num_layers: int
    num_experts: int
    layers: tuple[int, ...] | None = None

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(self.layers is None or i in self.layers for i in range(self.num_layers))

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if moe]


def _indices(text: str, limit: int, what: str, item: str) -> list[int]:
    if text.strip() == "*":
        return list(range(limit))
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise InvalidArgumentError(
                "experts", f"{what} {part.strip()!r} in {item!r} is not N or A-B"
            ) from None
        if not 0 <= a <= b < limit:
            raise InvalidArgumentError(
                "experts", f"{what} {part.strip()!r} in {item!r} is outside [0, {limit - 1}]"
            )
        out += range(a, b + 1)
    return out


def parse_experts(text: str, spec: ModelSpec | ModelShape) -> list[Pair]:
    """The sorted (layer, expert) pairs a spec names; '*' layers skip dense (non-MoE) layers."""
    pairs: set[Pair] = set()
    for item in (i.strip() for i in text.split(";")):
        if not item:
            continue
        layers, sep, experts = item.partition(":")
        if not sep:
            raise InvalidArgumentError(
                "experts", f"item {item!r} is not LAYERS:EXPERTS (e.g. '0-3:0,1' or '*:*')"
            )
        wildcard = layers.strip() == "*"
        for layer in _indices(layers, spec.num_layers, "layer", item):
            if not spec.moe_layers[layer]:
                if wildcard:
                    continue
                raise InvalidArgumentError(
                    "experts",
                    f"layer {layer} in {item!r} is a dense layer; MoE layers: {spec.moe_layer_ids}",
                )
            pairs.update((layer, e) for e in _indices(experts, spec.num_experts, "expert", item))
    if not pairs:
        raise InvalidArgumentError("experts", f"{text!r} names no expert")
    return sorted(pairs)


def format_experts(pairs: list[Pair]) -> str:
    """A compact spec for pairs, grouping layers that serve the same experts."""
    by_layer: dict[int, list[int]] = {}
    for layer, e in sorted(pairs):
        by_layer.setdefault(layer, []).append(e)

    def ranges(xs: list[int]) -> str:
        runs, start = [], xs[0]
        for prev, x in zip(xs, xs[1:] + [None]):
            if x != prev + 1 if x is not None else True:
                runs.append(f"{start}-{prev}" if prev != start else str(start))
                start = x
        return ",".join(runs)

    groups: dict[str, list[int]] = {}
    for layer, experts in by_layer.items():
        groups.setdefault(ranges(experts), []).append(layer)
    return "; ".join(f"{ranges(layers)}:{experts}" for experts, layers in groups.items())
