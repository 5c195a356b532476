"""Routed experts (and a router's attention and LM head) held in the kernels' panels, packed once
a host into files every process maps.

Where a process holds experts in a layout no checkpoint stores (bfloat16 panels, int8 or int4
quantized from the checkpoint's weights, or an FP8 checkpoint's e4m3 bytes with their block
scales, common/quant.py), each expert is packed straight from the checkpoint's pages into a
common/packcache.py file, block by block, and mapped from there: one copy a host, not one a
process, and a restart maps it instead of packing again.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common import bf16, fp8, packcache, quant
from common.errors import CheckpointError
from common.linear import in_panels
from common.quant import Quantization, QuantPanels
from common.weights import FFNWeights

if TYPE_CHECKING:
    from common.checkpoint import Checkpoint

# Weights pack block by block, each block's pages released once packed.
COPY_BLOCK_BYTES = 16 << 20


class PackedExperts:
    """One checkpoint's experts in panels (Checkpoint.load_experts asks `expert` first)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.ckpt = checkpoint

    def expert(self, expert: int, base: str, entry: str) -> FFNWeights | None:
        """The expert `expert` of the layer whose experts' tensors start with `base`, from this
        host's cache file `entry` (built where there is none valid); None where this process
        holds experts otherwise (plain, or in oneDNN's layout)."""
        ck, s = self.ckpt, self.ckpt.spec
        i, h = s.expert_intermediate_size, s.hidden_size
        if self.ckpt.has(base + "gate_up_proj"):  # fused: [E, 2I, H] and [E, H, I]
            names = [base + "gate_up_proj", base + "down_proj"]
            gate_up = [ck.view(names[0], (s.num_experts, 2 * i, h))[1][expert]]
            down = ck.view(names[1], (s.num_experts, h, i))[1][expert]
        else:
            p, n = f"{base}{expert}.", ck.names
            names = [f"{p}{name}.weight" for name in (n.expert_gate, n.expert_up, n.expert_down)]
            gate_up = [ck.view(name, (i, h))[1] for name in names[:2]]
            down = ck.view(names[2], (h, i))[1]
        shapes = {"gate_up": (2 * i, h), "down": (h, i)}
        q = self._format(down.dtype, names, shapes)
        if q is None and down.dtype == fp8.FP8:
            return None  # dequantized at load (Checkpoint.tensor)
        if q is None and not (
            ck.prepacked
            and packcache.enabled()
            and down.dtype.is_floating_point
            and all(in_panels(ck.dtype or down.dtype, x) for x in shapes.values())
        ):
            return None
        if q is None:
            sizes = {w: (a * b, torch.bfloat16) for w, (a, b) in shapes.items()}
        else:
            sizes = {
                f"{w}.{part}": size for w, x in shapes.items() for part, size in q.layout(x).items()
            }
        parts = {"gate_up": list(zip(gate_up, names)), "down": [(down, names[-1])]}

        def fill(out: dict[str, torch.Tensor]) -> None:
            for weight, views in parts.items():
                self._pack_rows(views, out, weight, q)

        tensors = self.entry(entry + ("" if q is None else f"-{q.name}"), sizes, fill)
        if q is None:
            weights = {w: bf16.Panels.of(tensors[w], x) for w, x in shapes.items()}
        else:
            weights = {
                w: QuantPanels.of(tensors[f"{w}.data"], tensors[f"{w}.scales"], x, q)
                for w, x in shapes.items()
            }
        return FFNWeights(**weights, activation=s.activation)

    def dense(self, parts: list[tuple[str, tuple[int, int]]]) -> bf16.Panels | None:
        """The dense weights `parts` (name and [out, in] shape each) stacked along rows (q, k and
        v as one qkv) in panels, from this host's cache file (built where there is none valid):
        every engine on a host then maps one copy of the dense part as of the experts. None
        where this process holds them otherwise (Checkpoint.pack makes its own)."""
        ck = self.ckpt
        views = [ck.view(name, shape)[1] for name, shape in parts]
        stored = views[0].dtype
        shape = (sum(v.shape[0] for v in views), views[0].shape[1])
        if not (
            ck.prepacked
            and packcache.enabled()
            and stored.is_floating_point
            and stored != fp8.FP8  # dequantized at load (Checkpoint.tensor)
            and all(v.dtype == stored and v.shape[0] % bf16.PANEL == 0 for v in views)
            and in_panels(ck.dtype or stored, shape)
        ):  # packed part by part: each a whole number of panels
            return None
        names = [name for name, _ in parts]
        tensors = self.entry(
            f"dense-{names[0]}-{len(names)}",
            {"w": (shape[0] * shape[1], torch.bfloat16)},
            lambda out: self._pack_rows(list(zip(views, names)), out, "w", None),
        )
        return bf16.Panels.of(tensors["w"], shape, tiles=not ck.batch_invariant)

    def entry(
        self, name: str, sizes: packcache.Sizes, fill: Callable[[dict[str, torch.Tensor]], None]
    ) -> dict[str, torch.Tensor]:
        """Packed tensors `name` of `sizes`: mapped from this host's cache file (`fill` writes
        one where none is valid), or with MOE_MESH_PACK_CACHE=off filled in this process."""
        if packcache.enabled():
            return self._packs.get(name, sizes, fill)
        return packcache.in_memory(sizes, fill)

    def _format(
        self, stored: torch.dtype, names: list[str], shapes: dict[str, tuple[int, int]]
    ) -> Quantization | None:
        """The quantized format these experts are held in (--quantize, or an FP8 checkpoint's);
        None for bfloat16 panels or plain. CheckpointError naming what keeps them from it."""
        ck = self.ckpt
        q, compute = ck.quantize, ck.dtype or stored
        if stored == fp8.FP8:
            if q is not None:
                raise CheckpointError(
                    f"quantize {q.name}: this checkpoint's experts are FP8, computed as published",
                    tensor=names[-1],
                )
            q = Quantization("fp8", ck.spec.fp8_block[1]) if ck.spec.fp8_block else None
            usable = ck.prepacked and bf16.kernel("moe_silu_ffns") is not None
            if q is None or compute == fp8.FP8 or not usable:
                return None  # dequantized at load (Checkpoint.tensor)
            compute = ck.dtype or torch.bfloat16
            if compute != torch.bfloat16 or not all(q.fits(x) for x in shapes.values()):
                return None
        if q is None:
            return None
        if compute != torch.bfloat16:
            raise CheckpointError(
                f"{q.name} experts compute with bfloat16 activations, but this checkpoint is "
                f"served in {compute}: set dtype bfloat16",
                tensor=names[-1],
            )
        if bf16.kernel("moe_silu_ffns") is None:
            raise CheckpointError(
                f"{q.name} experts need the C kernels (a C compiler and AVX2, and "
                "MOE_MESH_MAX_ISA unset or avx2 and above)"
            )
        for name, shape in zip([names[0], names[-1]], shapes.values()):
            q.check(shape, name)
        return q

    def _pack_rows(
        self,
        parts: list[tuple[torch.Tensor, str]],
        out: dict[str, torch.Tensor],
        name: str,
        q: Quantization | None,
    ) -> None:
        """`parts` (file views, with their names) stacked and packed into weight `name` of `out`,
        COPY_BLOCK_BYTES of them at a time (bfloat16 panels converted as Checkpoint.tensor
        converts, quantized, or FP8 rearranged), each block's pages released once packed."""
        at = 0  # rows packed so far
        for part, part_name in parts:
            k = part.shape[1]
            scales = None if q is None or q.scheme != "fp8" else self._fp8_scales(part, part_name)
            rows = COPY_BLOCK_BYTES // (k * part.element_size())
            step = max(bf16.PANEL, rows // bf16.PANEL * bf16.PANEL)
            for start in range(0, part.shape[0], step):
                block = part[start : start + step]
                n = block.shape[0]
                if q is None:
                    bf16.pack(block.to(torch.bfloat16), out[name][at * k : (at + n) * k])
                else:
                    before, size = q.layout((at, k)), q.layout((n, k))
                    data, packed_scales = (
                        out[f"{name}.{p}"][before[p][0] : before[p][0] + size[p][0]]
                        for p in ("data", "scales")
                    )
                    if scales is None:
                        quant.pack(block, q, data, packed_scales)
                    else:
                        fp8.pack(
                            block, scales, self.ckpt.spec.fp8_block, start, data, packed_scales
                        )
                self.ckpt.release(block)
                at += n

    def _fp8_scales(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        return self.ckpt.fp8_scales(name, tuple(weight.shape))

    @functools.cached_property
    def _packs(self) -> packcache.PackCache:
        """This checkpoint's packed-weight files, keyed by its content (fingerprint, and each
        file's size and modification time) and the layouts: not the dtype it was opened in, as
        panels are bfloat16 whatever the checkpoint stores, converted alike (a quantized entry
        names its precision)."""
        ck = self.ckpt
        stats = [(f, (st := (ck.path / f).stat()).st_size, st.st_mtime_ns) for f in ck.files()]
        content = [ck.fingerprint(), stats, bf16.LAYOUT, quant.LAYOUT]
        key = hashlib.sha256(json.dumps(content).encode()).hexdigest()[:32]
        return packcache.PackCache(ck.path, key)
