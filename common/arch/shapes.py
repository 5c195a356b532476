"""The shape config.json implies for each tensor of a checkpoint, checked against the safetensors
headers alone: no tensor data is read and torch is not imported.

`moe-mesh up` runs `check_checkpoint` before it starts any process, and every service through
common/checkpoint.py before it loads a weight, so a config that does not match its weights (a
wrong hidden_size) is refused at once (exit 2), naming the tensor, its shape, and the config
fields and values that imply another. The rules cover every family of common/arch (FAMILIES), per
expert or fused, float or MXFP4; a tensor they do not name (FP8 scales, whose shapes follow the
block size, multi-token-prediction layers past num_hidden_layers) is left to the loader, which
checks each tensor it reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.arch import load_spec
from common.arch.spec import ModelSpec
from common.errors import CheckpointError
from common.safetensors_header import read_header

INDEX_FILE = "model.safetensors.index.json"
# name -> (shape, file name) as the headers give them
Shapes = Mapping[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Dim:
    """One dimension a config implies, and why: the config fields and values that give it."""

    value: int
    why: str

    def __mul__(self, other: Dim | int) -> Dim:
        o = _dim(other)
        return Dim(self.value * o.value, f"{self.why} × {o.why}")

    def __add__(self, other: Dim | int) -> Dim:
        o = _dim(other)
        return Dim(self.value + o.value, f"({self.why} + {o.why})")


def _dim(x: Dim | int) -> Dim:
    return x if isinstance(x, Dim) else Dim(x, str(x))


def _named(config: dict[str, Any], value: int, *keys: str) -> Dim:
    """`value` labelled by the first of `keys` config.json spells (families differ)."""
    key = next((k for k in keys if k in config), keys[0])
    return Dim(value, f"{key}={value}")


def _fields(spec: ModelSpec, config: dict[str, Any]) -> dict[str, Dim]:
    """The spec's sizes, each labelled by the config field it came from."""
    s, c = spec, config
    if s.family == "dbrx":
        inter = s.expert_intermediate_size
        return dict(
            vocab=Dim(s.vocab_size, f"vocab_size={s.vocab_size}"),
            hidden=Dim(s.hidden_size, f"d_model={s.hidden_size}"),
            heads=Dim(s.num_heads, f"n_heads={s.num_heads}"),
            kv_heads=Dim(s.num_kv_heads, f"attn_config.kv_n_heads={s.num_kv_heads}"),
            head_dim=Dim(s.head_dim, f"d_model / n_heads={s.head_dim}"),
            experts=Dim(s.num_experts, f"ffn_config.moe_num_experts={s.num_experts}"),
            expert=Dim(inter, f"ffn_config.ffn_hidden_size={inter}"),
        )
    moe_width = (
        "intermediate_size"
        if s.family in ("mixtral", "olmoe", "gpt_oss")
        else "moe_intermediate_size"
    )
    if s.family in ("deepseek_v3", "glm4_moe"):
        n = s.shared_expert_intermediate_size // max(1, s.expert_intermediate_size)
        shared = Dim(
            s.shared_expert_intermediate_size,
            f"moe_intermediate_size={s.expert_intermediate_size} × n_shared_experts={n}",
        )
    else:
        shared = _named(c, s.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    head_dim = (
        _named(c, s.head_dim, "head_dim")
        if "head_dim" in c
        else Dim(s.head_dim, f"hidden_size / num_attention_heads={s.head_dim}")
    )
    return dict(
        vocab=_named(c, s.vocab_size, "vocab_size"),
        hidden=_named(c, s.hidden_size, "hidden_size"),
        heads=_named(c, s.num_heads, "num_attention_heads"),
        kv_heads=_named(c, s.num_kv_heads, "num_key_value_heads", "num_attention_heads"),
        head_dim=head_dim,
        experts=_named(c, s.num_experts, "num_experts", "num_local_experts", "n_routed_experts"),
        expert=_named(c, s.expert_intermediate_size, moe_width),
        dense=_named(c, s.dense_intermediate_size, "intermediate_size"),
        shared=shared,
    )


def _ffn(prefix: str, names: tuple[str, str, str], inter: Dim, h: Dim) -> dict[str, tuple]:
    gate, up, down = names
    return {
        f"{prefix}{gate}.weight": (inter, h),
        f"{prefix}{up}.weight": (inter, h),
        f"{prefix}{down}.weight": (h, inter),
    }


def _attention(spec: ModelSpec, config: dict[str, Any], f: dict[str, Dim]) -> dict[str, tuple]:
    """self_attn.* of a q/k/v/o family, or DeepSeek's latent attention."""
    h, p = f["hidden"], "self_attn."
    if spec.mla is not None:
        m = {
            k: _named(config, getattr(spec.mla, k), k) for k in vars(spec.mla) if k != "q_lora_rank"
        }
        q_out = f["heads"] * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
        kv_lora, rope = m["kv_lora_rank"], m["qk_rope_head_dim"]
        kv_b = f["heads"] * (m["qk_nope_head_dim"] + m["v_head_dim"])
        out = {
            p + "q_proj.weight": (q_out, h),
            p + "kv_a_proj_with_mqa.weight": (kv_lora + rope, h),
            p + "kv_a_layernorm.weight": (kv_lora,),
            p + "kv_b_proj.weight": (kv_b, kv_lora),
            p + "o_proj.weight": (h, f["heads"] * m["v_head_dim"]),
            p + "o_proj.bias": (h,),
        }
        if spec.mla.q_lora_rank is not None:
            q_lora = _named(config, spec.mla.q_lora_rank, "q_lora_rank")
            out |= {
                p + "q_a_proj.weight": (q_lora, h),
                p + "q_a_layernorm.weight": (q_lora,),
                p + "q_b_proj.weight": (q_out, q_lora),
            }
        return out
    q_out, kv_out = f["heads"] * f["head_dim"], f["kv_heads"] * f["head_dim"]
    norm_q, norm_k = (q_out, kv_out) if spec.qk_norm == "full" else (f["head_dim"],) * 2
    out = {
        p + "o_proj.weight": (h, q_out),
        p + "o_proj.bias": (h,),
        p + "q_norm.weight": (norm_q,),
        p + "k_norm.weight": (norm_k,),
        p + "sinks": (f["heads"],),
    }
    for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out)):
        out |= {f"{p}{n}_proj.weight": (o, h), f"{p}{n}_proj.bias": (o,)}
    return out


def _moe(spec: ModelSpec, f: dict[str, Dim]) -> dict[str, tuple]:
    """A MoE layer's router, routed experts (per expert or fused) and shared experts."""
    h, e, i, s = f["hidden"], f["experts"], f["expert"], f["shared"]
    if spec.family == "gpt_oss":  # fused [E, in, out], biased router and experts
        return {
            "mlp.router.weight": (e, h),
            "mlp.router.bias": (e,),
            "mlp.experts.gate_up_proj": (e, h, i * 2),
            "mlp.experts.down_proj": (e, i, h),
            "mlp.experts.gate_up_proj_bias": (e, i * 2),
            "mlp.experts.down_proj_bias": (e, h),
            **_mxfp4("mlp.experts.gate_up_proj", e, i * 2, h),
            **_mxfp4("mlp.experts.down_proj", e, h, i),
        }
    mixtral = spec.family == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, tuple] = {}
    for m in ("block_sparse_moe.", "mlp.") if mixtral else ("mlp.",):
        out |= {
            m + "gate.weight": (e, h),
            m + "gate.e_score_correction_bias": (e,),
            m + "experts.gate_up_proj": (e, i * 2, h),
            m + "experts.down_proj": (e, h, i),
            **_ffn(m + "experts.*.", names, i, h),
        }
    if spec.family == "qwen2_moe":
        out |= _ffn("mlp.shared_expert.", ("gate_proj", "up_proj", "down_proj"), s, h)
        out["mlp.shared_expert_gate.weight"] = (Dim(1, "1"), h)
    elif spec.family in ("deepseek_v3", "glm4_moe"):
        out |= _ffn("mlp.shared_experts.", ("gate_proj", "up_proj", "down_proj"), s, h)
    return out


def _mxfp4(name: str, e: Dim, rows: Dim, cols: Dim) -> dict[str, tuple]:
    """gpt-oss's MXFP4 experts: 16 bytes of 32 codes per block, one scale a block. Rows of a
    length that blocks do not divide are left to the loader, which says so."""
    if cols.value % 32:
        return {}
    groups = Dim(cols.value // 32, f"{cols.why} / 32")
    return {name + "_blocks": (e, rows, groups, Dim(16, "16")), name + "_scales": (e, rows, groups)}


def _dbrx_block(f: dict[str, Dim]) -> dict[str, tuple]:
    h, e, i, hd = f["hidden"], f["experts"], f["expert"], f["head_dim"]
    a = "norm_attn_norm."
    return {
        a + "norm_1.weight": (h,),
        a + "norm_2.weight": (h,),
        a + "attn.Wqkv.weight": ((f["heads"] + f["kv_heads"] * 2) * hd, h),
        a + "attn.out_proj.weight": (h, f["heads"] * hd),
        "ffn.router.layer.weight": (e, h),
        **{f"ffn.experts.mlp.{n}": (e * i, h) for n in ("w1", "v1", "w2")},
    }


@dataclass(frozen=True)
class Rules:
    """The implied shapes of one checkpoint: top-level tensors, and per layer kind (MoE or not)."""

    top: dict[str, tuple]
    layers: dict[bool, dict[str, tuple]]
    experts: Dim
    num_layers: int

    @classmethod
    def of(cls, spec: ModelSpec, config: dict[str, Any]) -> Rules:
        f = _fields(spec, config)
        h, v = f["hidden"], f["vocab"]
        if spec.family == "dbrx":
            block = _dbrx_block(f)
            top = {"transformer.wte.weight": (v, h), "transformer.norm_f.weight": (h,)}
            layers = {True: block, False: block}
        else:
            common = {
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
                **_attention(spec, config, f),
            }
            dense = _ffn("mlp.", ("gate_proj", "up_proj", "down_proj"), f["dense"], h)
            layers = {True: common | _moe(spec, f), False: common | dense}
            top = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        top["lm_head.weight"] = (v, h)
        return cls(top, layers, f["experts"], spec.num_layers)

    def required(self, spec: ModelSpec) -> dict[str, str]:
        """Tensors every checkpoint of this config holds (its embedding, final norm and each
        layer's first norm), each with what asks for it."""
        embed, norm = list(self.top)[:2]
        dbrx = spec.family == "dbrx"
        prefix = "transformer.blocks" if dbrx else "model.layers"
        first = "norm_attn_norm.norm_1.weight" if dbrx else "input_layernorm.weight"
        field = "n_layers" if dbrx else "num_hidden_layers"
        out = {embed: "the embedding", norm: "the final norm"}
        for i in range(self.num_layers):
            out[f"{prefix}.{i}.{first}"] = f"layer {i} of {field}={self.num_layers} in config.json"
        return out

    def order(self, name: str) -> tuple:
        """The model's order (embedding first, then layer by layer), not the files': the first
        error reported is the one a reader expects."""
        top = list(self.top)
        if name in top:
            return (0, top.index(name), 0, name)
        m = _LAYER.fullmatch(name)
        return (1, int(m["layer"]), 0, name) if m else (2, 0, 0, name)

    def expected(self, spec: ModelSpec, name: str) -> tuple | str | None:
        """The shape `name` must have; a message when its very name contradicts the config (an
        expert index past the experts); None for a tensor no rule names."""
        if name in self.top:
            return self.top[name]
        m = _LAYER.fullmatch(name)
        if m is None or int(m["layer"]) >= self.num_layers:
            return None  # not a decoder layer's, or a multi-token-prediction layer past them
        rest, expert = m["rest"], _EXPERT.search(m["rest"])
        if expert is not None:
            if int(expert["index"]) >= self.experts.value:
                return f"expert {expert['index']} is past the config's {self.experts.why}"
            rest = rest[: expert.start()] + "experts.*." + rest[expert.end() :]
        return self.layers[spec.moe_layers[int(m["layer"])]].get(rest)


_LAYER = re.compile(r"(?:model\.layers|transformer\.blocks)\.(?P<layer>\d+)\.(?P<rest>.+)")
_EXPERT = re.compile(r"experts\.(?P<index>\d+)\.")


def mismatches(spec: ModelSpec, config: dict[str, Any], shapes: Shapes) -> list[CheckpointError]:
    """Every tensor whose stored shape is not the one `config` implies, as errors naming the
    tensor, its file, its shape and the config fields of each dimension that differs."""
    rules, out = Rules.of(spec, config), []
    for name in sorted(shapes, key=rules.order):
        shape, file = shapes[name]
        want = rules.expected(spec, name)
        if want is None:
            continue
        if isinstance(want, str):
            out.append(CheckpointError(want, file=file, tensor=name))
            continue
        if tuple(shape) == tuple(d.value for d in want):
            continue
        dims = range(len(want)) if len(shape) != len(want) else (
            k for k, d in enumerate(want) if shape[k] != d.value
        )  # fmt: skip
        why = "; ".join(f"dim {k}: {want[k].why}" for k in dims)
        message = (
            f"wrong shape {list(shape)}, config implies {[d.value for d in want]} "
            f"({why} in config.json)"
        )
        out.append(CheckpointError(message, file=file, tensor=name))
    where = str(Path(next(iter(shapes.values()))[1]).parent) if shapes else None
    for name, why in rules.required(spec).items():
        if name not in shapes:
            out.append(CheckpointError(f"missing tensor ({why})", file=where, tensor=name))
    return out


def check_shapes(spec: ModelSpec, config: dict[str, Any], shapes: Shapes) -> None:
    """CheckpointError for the first tensor whose shape the config contradicts (with a count of
    the others: a wrong hidden_size contradicts nearly every tensor)."""
    if problems := mismatches(spec, config, shapes):
        first = problems[0]
        more = f"; and {len(problems) - 1} more tensor(s)" if len(problems) > 1 else ""
        raise CheckpointError(f"{first}{more}")


def header_shapes(checkpoint_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, file) from the headers of the checkpoint's safetensors files (the files
    its index lists, else every *.safetensors); a missing, truncated or corrupt file is a
    CheckpointError naming it."""
    d = Path(checkpoint_dir)
    index = d / INDEX_FILE
    if index.exists():
        files = sorted(set(read_index(index).values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise CheckpointError("no *.safetensors files", file=str(d))
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        path = d / name
        if not path.is_file():
            raise CheckpointError("safetensors file listed in the index is missing", file=str(path))
        for tensor, shape in _header(path).items():
            out[tensor] = (shape, str(path))
    return out


def read_index(index: Path) -> dict[str, str]:
    """An index's tensor name -> shard file, each shard checked to be a file name beside it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"invalid index ({e!r})", file=str(index)) from e
    if not isinstance(weight_map, dict):
        raise CheckpointError("invalid index: weight_map is not an object", file=str(index))
    for name, shard in weight_map.items():
        # Shards live beside the index: a path elsewhere is a broken (or hostile) index.
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"invalid index: tensor {name!r} maps to {shard!r}, expected a file name in the "
                "checkpoint directory",
                file=str(index),
            )
    return dict(weight_map)


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    header, data_start, size = read_header(path)
    try:
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in entries.items()}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"corrupt safetensors header: {e!r}", file=str(path)) from e
    if data_start + end > size:
        raise CheckpointError(
            f"corrupt safetensors header: its tensors end at byte {data_start + end}, the file has "
            f"{size} (truncated: an interrupted download or copy?)",
            file=str(path),
        )
    return shapes


def check_checkpoint(checkpoint_dir: Path, spec: ModelSpec | None = None) -> ModelSpec:
    """Every check of a checkpoint that reads no tensor data: config.json parses as a supported
    family, the safetensors files are there and whole, and every tensor has the shape the config
    implies. CheckpointError naming the file, tensor and config field; the spec when all pass."""
    spec = spec or load_spec(checkpoint_dir)
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    check_shapes(spec, config, header_shapes(checkpoint_dir))
    return spec
