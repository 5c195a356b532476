"""A moe-mesh checkpoint (HuggingFace layout) as a GGUF file that llama.cpp loads, so that
bench/vs_llamacpp.py times both engines on the same weights.

Written with the `gguf` package (pure Python, llama.cpp's own gguf-py) rather than llama.cpp's
`convert_hf_to_gguf.py`: that script ships in llama-cpp-python's sdist only (not its wheel), loads
transformers and refuses a BPE tokenizer whose pre-tokenizer hash it does not know, which is every
tokenizer `moe-mesh checkpoint create` writes. The tensors are read through moe-mesh's own
checkpoint reader (common/checkpoint.py: per-expert or fused experts, shapes checked against the
config) and mapped as convert_hf_to_gguf maps them:

- Mixtral becomes llama.cpp's `llama` architecture with experts, its q and k rows permuted
  (llama.cpp rotates adjacent pairs, transformers the two halves of a head); Qwen3-MoE becomes
  `qwen3moe` (halves, q/k norms, no permutation).
- Experts are stacked per layer: ffn_gate_exps / ffn_up_exps [experts, ffn, hidden] and
  ffn_down_exps [experts, hidden, ffn].
- Norms and the router stay float32 (as convert_hf_to_gguf keeps them); every other matrix is in
  `weights` (f32 or bf16); the routed experts are in `experts` (the weights' type, or q8_0 / q4_0:
  what the quantized-experts work quantizes, quantized by gguf-py's bit-exact copies of ggml's
  reference quantizers).
- The tokenizer is the checkpoint's byte-level BPE as llama.cpp's `gpt2` model with the GPT-2
  pre-tokenizer (what the tokenizer's ByteLevel pre-tokenizer splits by).

A converted file is cached next to the checkpoint (`<checkpoint>-<weights>-<experts>.gguf`) and
records the checkpoint's fingerprint, the types and this converter's version in its metadata; a
file whose record differs, or that does not parse, is rebuilt (written beside and renamed in).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import Checkpoint
from common.errors import CheckpointError

CONVERTER_VERSION = 1  # bump when the mapping changes: cached files rebuild
SOURCE_KEY = "moe_mesh.source"  # metadata: what the file was converted from, and how
WEIGHT_TYPES = ("f32", "bf16")
EXPERT_TYPES = ("f32", "bf16", "q8_0", "q4_0")
# checkpoint family -> (llama.cpp architecture, q/k rows permuted to llama.cpp's RoPE pairing)
ARCHS = {"mixtral": ("llama", True), "qwen3_moe": ("qwen3moe", False)}


@dataclass(frozen=True)
class Item:
    """One tensor of the file: its GGUF name, its type, and how to read it (torch, [rows, cols]
    in transformers' order; GGUF stores the same bytes with the dimensions reversed)."""

    name: str
    qtype: str  # f32 | bf16 | q8_0 | q4_0
    load: Callable[[], torch.Tensor]


def gguf_path(checkpoint: Path, weights: str = "bf16", experts: str | None = None) -> Path:
    """Where the GGUF of `checkpoint` in these types is cached: beside the checkpoint."""
    checkpoint = Path(checkpoint).resolve()
    return checkpoint.with_name(f"{checkpoint.name}-{weights}-{experts or weights}.gguf")


def source_record(checkpoint: Path, weights: str, experts: str) -> str:
    fingerprint = Checkpoint(checkpoint).fingerprint()
    return f"{fingerprint} weights={weights} experts={experts} v{CONVERTER_VERSION}"


def cached_gguf(checkpoint: Path, weights: str = "bf16", experts: str | None = None) -> Path:
    """The GGUF of `checkpoint`, converted on first use and whenever the cached file is stale
    (another checkpoint, types or converter version) or unreadable."""
    experts = experts or weights
    out = gguf_path(checkpoint, weights, experts)
    want = source_record(checkpoint, weights, experts)
    if out.exists():
        have = recorded_source(out)
        if have == want:
            return out
        why = "unreadable" if have is None else f"from {have!r}, not {want!r}"
        print(f"[gguf] {out} is {why}: converting again", file=sys.stderr, flush=True)
    convert(checkpoint, out, weights, experts)
    return out


def recorded_source(path: Path) -> str | None:
    """The SOURCE_KEY record of a GGUF file; None when the file does not parse as GGUF."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).get_field(SOURCE_KEY)
        return None if field is None else str(field.contents())
    except Exception:  # noqa: BLE001 - any parse failure (truncated, not GGUF) means rebuild
        return None


def convert(checkpoint: Path, out: Path, weights: str = "bf16", experts: str | None = None) -> None:
    """Write `checkpoint` as GGUF at `out`, one tensor in memory at a time; built beside `out`
    and renamed into place when whole."""
    import gguf

    experts = experts or weights
    if weights not in WEIGHT_TYPES or experts not in EXPERT_TYPES:
        raise ValueError(
            f"types {weights}/{experts}: weights {WEIGHT_TYPES}, experts {EXPERT_TYPES}"
        )
    ckpt = Checkpoint(checkpoint)
    arch = supported_arch(ckpt)
    writer = gguf.GGUFWriter(None, arch)
    write_metadata(writer, ckpt, weights, experts)
    write_tokenizer(writer, Path(checkpoint))
    items = list(tensor_items(ckpt, weights, experts))
    # The file's plan first (names, shapes, types), then the data in the same order.
    shapes = [stored_shape(ckpt, item) for item in items]
    for item, shape in zip(items, shapes):
        dtype, nbytes = byte_layout(shape, item.qtype)
        raw = None if item.qtype == "f32" else gguf.GGMLQuantizationType[item.qtype.upper()]
        writer.add_tensor_info(item.name, byte_shape(shape, item.qtype), dtype, nbytes, raw)
    partial = out.with_name(out.name + ".partial")
    print(f"[gguf] converting {checkpoint} to {out} ({weights}, experts {experts})", flush=True)
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for item in items:
        writer.write_tensor_data(encode(item.load(), item.qtype))
    writer.close()
    os.replace(partial, out)


def supported_arch(ckpt: Checkpoint) -> str:
    """The llama.cpp architecture `ckpt` maps to; an error naming what it lacks otherwise."""
    s = ckpt.spec
    if s.family not in ARCHS:
        raise CheckpointError(
            f"family {s.family} is not converted to GGUF (converted: {', '.join(ARCHS)})",
            file=str(ckpt.path),
        )
    rope = s.rope
    checks = {
        "a dense or shared-expert layer": not all(s.moe_layers)
        or bool(s.shared_expert_intermediate_size),
        "attention biases, clipping, sinks, a sliding window or a set softmax scale": s.qkv_bias
        or s.o_bias
        or s.clip_qkv is not None
        or s.attention_sinks
        or s.sliding_window is not None
        or s.attention_scale is not None,
        "q/k norms other than the family's": s.qk_norm
        != ("none" if s.family == "mixtral" else "per_head"),
        "a router other than softmax, top-k, renormalised": s.router != "softmax"
        or (s.top_k > 1 and not s.norm_topk_prob)
        or s.router_bias
        or s.routed_scaling_factor != 1.0,
        "scaled, partial or interleaved RoPE": rope.scaling != "default"
        or rope.rotary_dim not in (None, s.head_dim)
        or rope.interleaved,
        "an activation other than SiLU or expert biases": s.activation.kind != "silu"
        or s.expert_bias,
    }
    why = [what for what, bad in checks.items() if bad]
    if why:
        raise CheckpointError(f"not convertible to GGUF: {'; '.join(why)}", file=str(ckpt.path))
    return ARCHS[s.family][0]


def write_metadata(writer, ckpt: Checkpoint, weights: str, experts: str) -> None:
    import gguf

    s = ckpt.spec
    writer.add_name(Path(ckpt.path).name)
    writer.add_string(SOURCE_KEY, source_record(ckpt.path, weights, experts))
    file_type = {"f32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    file_type["q4_0"] = "MOSTLY_Q4_0"
    writer.add_file_type(gguf.LlamaFileType[file_type[experts]])
    writer.add_vocab_size(s.vocab_size)
    writer.add_context_length(s.max_position_embeddings)
    writer.add_embedding_length(s.hidden_size)
    writer.add_block_count(s.num_layers)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_norm_eps)
    writer.add_expert_count(s.num_experts)
    writer.add_expert_used_count(s.top_k)
    if ARCHS[s.family][0] == "llama":  # Mixtral: the experts' width under the dense key
        writer.add_feed_forward_length(s.expert_intermediate_size)
    else:
        writer.add_feed_forward_length(s.dense_intermediate_size)
        writer.add_expert_feed_forward_length(s.expert_intermediate_size)


def write_tokenizer(writer, checkpoint: Path) -> None:
    """The checkpoint's byte-level BPE: its vocabulary in id order, merges, special tokens."""
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    model = data["model"]
    if model.get("type") != "BPE":
        raise CheckpointError("tokenizer is not BPE: not convertible", file=str(checkpoint))
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise CheckpointError("tokenizer ids are not 0..n-1", file=str(checkpoint))
    special = {t["id"]: t.get("special", False) for t in data.get("added_tokens", [])}
    types = [1 if i not in special else 3 if special[i] else 4 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    config = json.loads((checkpoint / "config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        if isinstance(config.get(f"{key}_token_id"), int):
            add(config[f"{key}_token_id"])
    if isinstance(config.get("pad_token_id"), int):
        writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)  # prompts are token ids; nothing is prepended


def tensor_items(ckpt: Checkpoint, weights: str, experts: str) -> Iterator[Item]:
    """Every tensor in llama.cpp's names, in the order the file holds them."""
    dense = ckpt.load_dense()  # views of the files: nothing is read until an item loads
    yield Item("token_embd.weight", weights, lambda: dense.embed)
    yield Item("output_norm.weight", "f32", lambda: dense.final_norm)
    if dense.lm_head is not dense.embed:  # tied: llama.cpp uses token_embd as the head
        yield Item("output.weight", weights, lambda: dense.lm_head)
    for i, layer in enumerate(dense.layers):
        yield from layer_items(ckpt, i, layer, weights, experts)


def layer_items(ckpt: Checkpoint, i: int, layer, weights: str, experts: str) -> Iterator[Item]:
    s, b = ckpt.spec, f"blk.{i}."
    q_rows, kv_rows = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    att = layer.attention
    permute = ARCHS[s.family][1]

    def rows(start: int, n: int, heads: int) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            w = att.qkv[start : start + n]  # [heads * head_dim, hidden]
            return pair_rotary_rows(w, heads) if permute and heads else w

        return load

    yield Item(b + "attn_norm.weight", "f32", lambda: layer.input_norm)
    yield Item(b + "attn_q.weight", weights, rows(0, q_rows, s.num_heads))
    yield Item(b + "attn_k.weight", weights, rows(q_rows, kv_rows, s.num_kv_heads))
    yield Item(b + "attn_v.weight", weights, rows(q_rows + kv_rows, kv_rows, 0))
    yield Item(b + "attn_output.weight", weights, lambda: att.o)
    if att.q_norm is not None:
        yield Item(b + "attn_q_norm.weight", "f32", lambda: att.q_norm)
        yield Item(b + "attn_k_norm.weight", "f32", lambda: att.k_norm)
    yield Item(b + "ffn_norm.weight", "f32", lambda: layer.post_attention_norm)
    yield Item(b + "ffn_gate_inp.weight", "f32", lambda: layer.router)  # [experts, hidden]
    for part in ("gate", "up", "down"):
        yield Item(f"{b}ffn_{part}_exps.weight", experts, lambda p=part: stacked(ckpt, i, p))


def pair_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows reordered from transformers' RoPE (dimension d with d + head_dim/2) to
    llama.cpp's `llama` RoPE (2j with 2j + 1): convert_hf_to_gguf's LlamaModel.permute."""
    out, hidden = w.shape
    return w.reshape(heads, 2, out // heads // 2, hidden).swapaxes(1, 2).reshape(out, hidden)


def stacked(ckpt: Checkpoint, layer: int, part: str) -> torch.Tensor:
    """One layer's experts' `part` stacked: gate/up [experts, ffn, hidden], down
    [experts, hidden, ffn]."""
    s = ckpt.spec
    ffns = ckpt.load_experts((layer, e) for e in range(s.num_experts))
    out = []
    for e in range(s.num_experts):
        f = ffns[(layer, e)]
        if part == "down":
            out.append(f.down)
        elif f.up is not None:  # stored apart: gate_up holds the gate alone
            out.append(f.gate_up if part == "gate" else f.up)
        else:  # [2 * ffn, hidden], gate rows first
            out.append(f.gate_up.chunk(2)[0 if part == "gate" else 1])
    return torch.stack(out)


def stored_shape(ckpt: Checkpoint, item: Item) -> tuple[int, ...]:
    """The element shape of `item` (transformers' order), from the spec: no weight is read."""
    s, name = ckpt.spec, item.name
    h, hd, e, f = s.hidden_size, s.head_dim, s.num_experts, s.expert_intermediate_size
    suffix = name.split(".")[-2]  # token_embd.weight, blk.3.attn_q.weight
    return {
        "token_embd": (s.vocab_size, h),
        "output_norm": (h,),
        "output": (s.vocab_size, h),
        "attn_norm": (h,),
        "attn_q": (s.num_heads * hd, h),
        "attn_k": (s.num_kv_heads * hd, h),
        "attn_v": (s.num_kv_heads * hd, h),
        "attn_output": (h, s.num_heads * hd),
        "attn_q_norm": (hd,),
        "attn_k_norm": (hd,),
        "ffn_norm": (h,),
        "ffn_gate_inp": (e, h),
        "ffn_gate_exps": (e, f, h),
        "ffn_up_exps": (e, f, h),
        "ffn_down_exps": (e, h, f),
    }[suffix]


def byte_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    """The shape add_tensor_info takes: elements for f32 and bf16, bytes per row for blocks."""
    import gguf

    if qtype in ("f32", "bf16"):
        return shape
    return gguf.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType[qtype.upper()])


def byte_layout(shape: tuple[int, ...], qtype: str) -> tuple[np.dtype, int]:
    dtype = {"f32": np.dtype(np.float32), "bf16": np.dtype(np.uint16)}.get(
        qtype, np.dtype(np.uint8)
    )
    return dtype, int(np.prod(byte_shape(shape, qtype))) * dtype.itemsize


def encode(t: torch.Tensor, qtype: str) -> np.ndarray:
    """`t` as the bytes GGUF stores for `qtype`. bfloat16 rounds as torch does (to nearest even),
    as the engine's own conversion of a float32 checkpoint does."""
    import gguf

    if qtype == "bf16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    as_f32 = t.to(torch.float32).contiguous().numpy()
    if qtype == "f32":
        return as_f32
    return gguf.quants.quantize(as_f32, gguf.GGMLQuantizationType[qtype.upper()])
