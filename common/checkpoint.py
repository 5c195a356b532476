"""Selective, memory-mapped loading of HuggingFace-layout MoE checkpoints.

A process loads only what it serves: the router the dense part (`load_dense`), an expert service
its (layer, expert) pairs (`load_experts`). Tensors are views into memory-mapped safetensors
files, so untouched tensors cost no memory. Experts may be stored per expert (published
checkpoints) or fused as 3-D tensors (transformers v5: gate_up_proj [E, 2I, H], down_proj [E, H, I]).

With `prepack=True` (what the services use) every matrix a linear layer reads is converted once
into this host's layout for its dtype (common/linear.py), a copy, no longer a view of the
file; with `batch_invariant=True` (expert services) into one whose products do not depend on a
row's batch-mates: moe-mesh's panels, oneDNN's layout, or for float32 the file's own layout
read by moe-mesh's kernel (then still a view).

Memory: a weight used as stored stays a view of the file, so processes on one host share its pages
(an expert's gate and up too: one view when the file stores them back to back, two views apart
when it does not, unless float32 products over the halves differ in bits from the joined one,
which is transformers'; float32.halves_agree). A weight converted, joined or repacked into a copy
has its file pages released as it is copied (`copied`, 16 MiB at a time) or once repacked
(SafetensorsFile.release), so a load peaks near what it keeps, not that plus the pages it read. Experts held in the kernels' panels (bfloat16, int8 or int4
with `quantize`, an FP8 checkpoint's own), and the attention and LM-head weights a router holds in
panels, are packed once per host into files that every process maps (common/packed_experts.py):
one copy a host. Other FP8 weights are dequantized at load
(common/fp8.py), and with `quantize_dense` the dense layers are quantized too.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch

from common import float32, fp8
from common.arch import ModelSpec, checkpoint_spec, family_module, tensor_names
from common.arch.shapes import check_checkpoint, read_index
from common.errors import CheckpointError, InvalidArgumentError, UnsupportedModelError
from common.float32_rows import Rows
from common.linear import in_float32_rows, prepack
from common.packed_experts import PackedExperts
from common.quant import Quantization, QuantPanels
from common.safetensors_mmap import SafetensorsFile
from common.weights import AttentionWeights, DenseWeights, FFNWeights, LayerWeights, to_device

INDEX_FILE = "model.safetensors.index.json"
# Copies of file tensors go block by block, each block's pages released once copied (`copied`).
COPY_BLOCK_BYTES = 16 << 20


class Checkpoint:
    """A checkpoint directory: config.json plus one or more safetensors files (optionally indexed)."""

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype | None = None,
        prepack: bool = False,
        batch_invariant: bool = False,
        quantize: Quantization | None = None,
        quantize_dense: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.path = Path(path)
        # On a GPU the weights are moved there as loaded (to_device); the CPU layouts (oneDNN's,
        # the kernels' panels, the packed-expert cache files) are CPU-only, so none is made.
        self.device = torch.device("cpu") if device is None else device
        on_cpu = self.device.type == "cpu"
        if not on_cpu and quantize is not None:
            raise InvalidArgumentError(
                "quantize",
                f"{quantize.name} experts compute on CPUs only; on {self.device} serve the "
                "checkpoint in bfloat16, float16 or float32 (--quantize none)",
            )
        self.prepacked, self.batch_invariant = prepack and on_cpu, batch_invariant
        # Routed experts (load_experts) and, with quantize_dense, the dense layers `pack` packs.
        self.quantize = quantize
        self._quantize_dense = quantize_dense and quantize is not None
        self.spec: ModelSpec = checkpoint_spec(self.path)
        # Every shape the config implies, from the headers alone: a broken checkpoint is refused
        # before any weight loads, naming the tensor and the config field (common/arch/shapes.py).
        check_checkpoint(self.path, self.spec)
        self.names = tensor_names(self.spec)
        # A family module may take over parts of loading (common/arch/__init__.py lists the hooks).
        self.family = family_module(self.spec.family)
        # None keeps the stored dtype (zero-copy); an FP8 checkpoint computes in bfloat16
        self.dtype = torch.bfloat16 if dtype is None and self.spec.fp8_block else dtype
        self._files: dict[str, SafetensorsFile] = {}
        self._where = self._index()

    # -- tensor lookup -------------------------------------------------------------------

    def _index(self) -> dict[str, str]:
        """Tensor name -> file name; from the index json when sharded, else from the file headers."""
        index = self.path / INDEX_FILE
        if index.exists():
            return read_index(index)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError("no *.safetensors files", file=str(self.path))
        where: dict[str, str] = {}
        for f in files:
            for name in self._file(f.name).tensors:
                where[name] = f.name
        return where

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            path = self.path / name
            if not path.exists():
                raise CheckpointError(
                    "safetensors file listed in the index is missing", file=str(path)
                )
            self._files[name] = SafetensorsFile(path)
        return self._files[name]

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        rows: slice | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The tensor `name`, checked against the shape the config implies; only `rows` of it
        when given (sliced before any dtype conversion: one expert of a fused tensor). In `dtype`
        when given, else the checkpoint's: floats convert (a correction bias stays float32 in a
        bfloat16 model); packed integer codes (MXFP4) must be stored in it."""
        file, t = self.view(name, shape)
        if t.dtype == fp8.FP8:
            return self._dequantized(name, t, rows, dtype or self.dtype)
        if rows is not None:
            t = t[rows]
        want = dtype or self.dtype
        if want is not None and t.dtype != want:
            if not (t.dtype.is_floating_point and want.is_floating_point):  # packed codes
                raise CheckpointError(
                    f"wrong dtype {t.dtype}, expected {want}", file=str(file.path), tensor=name
                )
            t = self.copied([t], want) if t.dim() else t.to(want)
        return t

    def _dequantized(
        self, name: str, t: torch.Tensor, rows: slice | None, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """An FP8 weight times its block scales, in `dtype` (bfloat16 by default: what FP8
        checkpoints are published to compute in), its file pages released."""
        if rows is not None or t.dim() != 2:
            raise CheckpointError("FP8 weights are read as 2-D [out, in] matrices", tensor=name)
        y = fp8.dequantize(
            t, self.fp8_scales(name, tuple(t.shape)), self.spec.fp8_block, dtype or torch.bfloat16
        )
        self.release(t)
        return y

    def fp8_scales(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """The weight_scale_inv of FP8 weight `name` [out, in], checked."""
        block, scale = self.spec.fp8_block, fp8.scale_name(name)
        if block is None:
            raise CheckpointError(
                "an FP8 tensor, but config.json has no quantization_config with quant_method "
                "'fp8' and its weight_block_size",
                tensor=name,
            )
        if scale not in self._where:
            raise CheckpointError("missing the scales of an FP8 weight", tensor=scale)
        scales = self._file(self._where[scale]).get(scale)
        fp8.check_scales(scales, shape, block, name)
        return scales

    def copied(self, parts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """`parts` stacked along their first dimension into one new tensor, in `dtype` (theirs by
        default), copied block by block with each block's file pages released once copied: the
        pages read and the copy never both hold a whole matrix (Mixtral-8x7B's gate and up are
        470 MB of float32). Parts that are not views of the files are just copied."""
        first = parts[0]
        rows = sum(part.shape[0] for part in parts)
        out = torch.empty((rows, *first.shape[1:]), dtype=dtype or first.dtype)
        flat, at = out.view(-1), 0
        for part in parts:
            src = part.reshape(-1)  # a view: what the files give is contiguous
            step = max(1, COPY_BLOCK_BYTES // src.element_size())
            for start in range(0, src.numel(), step):
                block = src[start : start + step]
                flat[at : at + block.numel()].copy_(block)  # rounds as .to(dtype) does
                self.release(block)
                at += block.numel()
        return out

    def view(self, name: str, shape: tuple[int, ...]) -> tuple[SafetensorsFile, torch.Tensor]:
        """The file holding `name`, and `name` as stored there (a view), checked against `shape`."""
        if name not in self._where:
            raise CheckpointError("missing tensor", file=str(self.path), tensor=name)
        file = self._file(self._where[name])
        if name not in file.tensors:
            raise CheckpointError(
                "tensor listed in the index is not in its file", file=str(file.path), tensor=name
            )
        t = file.get(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"wrong shape {list(t.shape)}, config implies {list(shape)}",
                file=str(file.path),
                tensor=name,
            )
        return file, t

    def pack(self, weight: torch.Tensor, tiles: bool = False) -> torch.Tensor:
        """A weight a linear layer reads: prepacked when this checkpoint was opened to serve (and
        then the file pages it was packed from released). `tiles`: a dense weight (linear.prepack)."""
        if not self.prepacked:
            return weight
        q = self.quantize if self._quantize_dense else None
        if q is not None and q.fits(tuple(weight.shape)):
            if (self.dtype or weight.dtype) != torch.bfloat16:
                raise CheckpointError(
                    f"{q.name} weights compute with bfloat16 activations, but this checkpoint "
                    f"is served in {self.dtype or weight.dtype}: set dtype bfloat16"
                )
            packed = QuantPanels(weight, q)
            self.release(weight)
            return packed
        packed = prepack(weight, self.batch_invariant, tiles)
        as_stored = isinstance(packed, Rows) and packed.data is weight
        if packed is not weight and not as_stored:
            self.release(weight)  # copied, so the pages it was read from go
        return packed

    def dense(self, parts: list[tuple[str, tuple[int, ...]]]) -> torch.Tensor:
        """The dense weights `parts` (name and shape each) stacked along rows, as a linear layer
        reads them: mapped from this host's packed-weight cache where held in panels (one copy a
        host, whatever the engines on it: PackedExperts.dense), else `pack`ed by this process."""
        rows = sum(shape[0] for _, shape in parts)
        q = self.quantize if self._quantize_dense else None
        if not (q is not None and q.fits((rows, parts[0][1][1]))):  # quantized: pack's own
            if (cached := self._packed.dense(parts)) is not None:
                return cached
        tensors = [self.tensor(name, shape) for name, shape in parts]
        return self.pack(self.copied(tensors) if len(tensors) > 1 else tensors[0], tiles=True)

    def release(self, *views: torch.Tensor) -> None:
        """Drop this process's file pages under `views`, copied into what is kept and read no
        more; a tensor that is not a view of this checkpoint's files is left alone."""
        for view in views:
            for file in self._files.values():
                if file.release(view):
                    break

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return self.tensor(name, shape) if present else None

    # -- dense part ------------------------------------------------------------------------

    def load_dense(self) -> DenseWeights:
        """Embeddings, attention, norms, routers, dense and shared MLPs, LM head: no routed expert."""
        s = self.spec
        embed_name, norm_name = getattr(
            self.family, "DENSE_NAMES", ("model.embed_tokens.weight", "model.norm.weight")
        )
        embed = self.tensor(embed_name, (s.vocab_size, s.hidden_size))
        tied = s.tie_word_embeddings and not self.has("lm_head.weight")
        # A tied head stays the embedding itself: a packed copy would double the largest matrix.
        lm_head = embed if tied else self.dense([("lm_head.weight", (s.vocab_size, s.hidden_size))])
        load_layer = getattr(self.family, "load_layer", Checkpoint.layer)
        dense = DenseWeights(
            embed=embed,
            final_norm=self.tensor(norm_name, (s.hidden_size,)),
            lm_head=lm_head,
            layers=[load_layer(self, i) for i in range(s.num_layers)],
        )
        return dense if self.device.type == "cpu" else to_device(dense, self.device)

    def layer(self, i: int) -> LayerWeights:
        """Layer i in the Llama-like layout the first four families share."""
        s, p = self.spec, f"model.layers.{i}."
        h = s.hidden_size
        layer = LayerWeights(
            input_norm=self.tensor(p + "input_layernorm.weight", (h,)),
            post_attention_norm=self.tensor(p + "post_attention_layernorm.weight", (h,)),
            attention=self.attention(p + "self_attn."),
        )
        if not s.moe_layers[i]:
            layer.dense_mlp = self.ffn(
                p + "mlp.", "gate_proj", "up_proj", "down_proj", s.dense_intermediate_size
            )
            return layer
        moe = p + self.moe_prefix(i)
        # The gate has a few dozen rows: packing buys nothing there, the plain kernel is quicker.
        layer.router = self.tensor(moe + "gate.weight", (s.num_experts, h))
        if s.shared_expert_intermediate_size:
            layer.shared_expert = self.ffn(
                moe + "shared_expert.",
                "gate_proj",
                "up_proj",
                "down_proj",
                s.shared_expert_intermediate_size,
            )
            layer.shared_expert_gate = self.tensor(moe + "shared_expert_gate.weight", (1, h))
        return layer

    def attention(self, p: str) -> AttentionWeights:
        """q/k/v/o attention under prefix p: one fused qkv matrix, the spec's biases and norms."""
        s = self.spec
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        norm_q, norm_k = {
            "none": (0, 0),
            "per_head": (s.head_dim, s.head_dim),
            "full": (q_out, kv_out),
        }[s.qk_norm]
        shapes = {"q": (q_out,), "k": (kv_out,), "v": (kv_out,)}
        qkv = [(f"{p}{n}_proj.weight", (*o, s.hidden_size)) for n, o in shapes.items()]
        biases = [self.tensor(f"{p}{n}_proj.bias", o) for n, o in shapes.items() if s.qkv_bias]
        return AttentionWeights(
            qkv=self.dense(qkv),  # [(heads + 2 * kv_heads) * head_dim, hidden]
            o=self.dense([(p + "o_proj.weight", (s.hidden_size, q_out))]),
            qkv_bias=torch.cat(biases) if biases else None,
            o_bias=self.optional(p + "o_proj.bias", (s.hidden_size,), s.o_bias),
            q_norm=self.optional(p + "q_norm.weight", (norm_q,), s.qk_norm != "none"),
            k_norm=self.optional(p + "k_norm.weight", (norm_k,), s.qk_norm != "none"),
        )

    def ffn(self, p: str, gate: str, up: str, down: str, inter: int) -> FFNWeights:
        """A gated FFN stored as three matrices under prefix p. Gate and up become one [2I, H]
        matrix: a view when the file stores them back to back in the compute dtype, else a copy,
        kept only when it is repacked, or float32 where two products over the halves would not
        give the joined one's bits; otherwise the two views are kept apart."""
        h = self.spec.hidden_size
        down_w = self.pack(self.tensor(f"{p}{down}.weight", (h, inter)))
        names = (f"{p}{gate}.weight", f"{p}{up}.weight")
        if (joined := self._joined(names, (inter, h))) is not None:
            gate_up = self.pack(joined)  # [2 * inter, hidden]
            return FFNWeights(gate_up=gate_up, down=down_w, activation=self.spec.activation)
        parts = [self.tensor(n, (inter, h)) for n in names]
        if self._stored(parts) and self._as_stored_rows(parts[0]):  # batch-invariant, as stored
            gate, up = (self.pack(part) for part in parts)
            return FFNWeights(gate_up=gate, up=up, down=down_w, activation=self.spec.activation)
        # float32 keeps transformers' one product over [gate; up] to the last bit: two views give
        # its bits where two products do (float32.halves_agree), else a joined copy.
        halves = self._stored(parts) and (
            parts[0].dtype != torch.float32
            or (self.device.type == "cpu" and float32.halves_agree(*parts))  # MKL's bits
        )
        if not halves:
            fused = self.copied(parts)  # [2 * inter, hidden], the pages read released
            gate_up = self.pack(fused)
            return FFNWeights(gate_up=gate_up, down=down_w, activation=self.spec.activation)
        fused = torch.cat(parts)  # [2 * inter, hidden]: the views may be what stays
        gate_up = self.pack(fused)
        if gate_up is fused:  # the layout is the file's: the views serve as they are
            del fused, gate_up
            return FFNWeights(
                gate_up=parts[0], up=parts[1], down=down_w, activation=self.spec.activation
            )
        self.release(*parts)
        return FFNWeights(gate_up=gate_up, down=down_w, activation=self.spec.activation)

    def _joined(self, names: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
        """`names` (each checked against `shape`) as one view of their file when it stores them
        back to back in the compute dtype; None where joining them takes a copy."""
        files = {self._where.get(n) for n in names}
        if len(files) != 1 or None in files:
            return None  # missing (tensor() says so) or in different files
        file, first = self.view(names[0], shape)
        for name in names[1:]:
            self.view(name, shape)
        if self.dtype is not None and first.dtype != self.dtype:
            return None
        return file.joined(names)

    def _as_stored_rows(self, weight: torch.Tensor) -> bool:
        """Whether `pack` keeps `weight` as stored, for moe-mesh's batch-invariant float32
        kernel (an expert service's; common/float32_rows.py)."""
        return (
            self.prepacked
            and self.batch_invariant
            and in_float32_rows(weight.dtype, tuple(weight.shape))
        )

    def _stored(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every tensor is a view of one of this checkpoint's mapped files."""
        return all(any(f.contains(t) for f in self._files.values()) for t in tensors)

    def moe_prefix(self, layer: int) -> str:
        for prefix in self.names.moe_prefixes:
            if self.has(f"model.layers.{layer}.{prefix}gate.weight"):
                return prefix
        return self.names.moe_prefixes[0]  # lets tensor() report the canonical missing name

    # -- routed experts --------------------------------------------------------------------

    def load_experts(self, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], FFNWeights]:
        """FFN weights of the given (layer, expert) pairs, and nothing else."""
        s, n = self.spec, self.names
        load_expert = getattr(self.family, "load_expert", None)
        out: dict[tuple[int, int], FFNWeights] = {}
        for layer, expert in sorted(set(pairs)):
            if not 0 <= layer < s.num_layers or not s.moe_layers[layer]:
                raise CheckpointError(
                    f"layer {layer} is not a MoE layer; MoE layers: {s.moe_layer_ids}"
                )
            if not 0 <= expert < s.num_experts:
                raise CheckpointError(
                    f"expert {expert} out of range; layer {layer} has {s.num_experts} experts"
                )
            base = f"model.layers.{layer}.{self.moe_prefix(layer)}experts."
            if load_expert is not None:
                if self.quantize is not None:
                    raise UnsupportedModelError(
                        f"{self.quantize.name} experts are not offered for {s.family}: its "
                        "experts load through their own format (common/arch)"
                    )
                out[(layer, expert)] = load_expert(self, layer, expert)
            elif (
                self.device.type == "cpu"
                and (cached := self._packed.expert(expert, base, f"layer{layer}-expert{expert}"))
                is not None
            ):
                out[(layer, expert)] = cached
            elif self.has(base + "gate_up_proj"):
                out[(layer, expert)] = self._fused_expert(base, expert)
            else:
                out[(layer, expert)] = self.ffn(
                    f"{base}{expert}.",
                    n.expert_gate,
                    n.expert_up,
                    n.expert_down,
                    s.expert_intermediate_size,
                )
        return out if self.device.type == "cpu" else to_device(out, self.device)

    def _fused_expert(self, base: str, expert: int) -> FFNWeights:
        s = self.spec
        e, i, h = s.num_experts, s.expert_intermediate_size, s.hidden_size
        # One expert's rows, sliced before any dtype conversion: not the whole [E, ...] tensor.
        one = slice(expert, expert + 1)
        gate_up = self.tensor(base + "gate_up_proj", (e, 2 * i, h), one)[0]  # [2I, H], gate first
        down = self.tensor(base + "down_proj", (e, h, i), one)[0]  # [H, I]
        return FFNWeights(gate_up=self.pack(gate_up), down=self.pack(down), activation=s.activation)

    @functools.cached_property
    def _packed(self) -> PackedExperts:
        return PackedExperts(self)

    def packed_entry(self, name: str, sizes, fill) -> dict[str, torch.Tensor]:
        """A family's packed weights `name`, once a host (PackedExperts.entry)."""
        return self._packed.entry(name, sizes, fill)

    def files(self) -> list[str]:
        """The safetensors files holding this checkpoint's tensors, sorted."""
        return sorted(set(self._where.values()))

    def fingerprint(self) -> str:
        """A cheap weights checksum: config.json, every file's header, and 64 KiB sampled across every file.

        Routers and expert services compare it to make sure they serve the same weights; it reads a
        constant amount per file, so it costs milliseconds even for very large checkpoints.
        """
        digest = hashlib.sha256((self.path / "config.json").read_bytes())
        for name in self.files():
            path = self.path / name
            size = path.stat().st_size
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                digest.update(f.read(header_len))
                for i in range(16):
                    f.seek(8 + header_len + (size - 8 - header_len) * i // 16)
                    digest.update(f.read(4096))
        return digest.hexdigest()[:16]

    def all_expert_pairs(self) -> list[tuple[int, int]]:
        return [
            (layer, e) for layer in self.spec.moe_layer_ids for e in range(self.spec.num_experts)
        ]
