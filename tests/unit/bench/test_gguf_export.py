"""bench/gguf_export.py: a checkpoint as GGUF holds every tensor under llama.cpp's name, in its
shape and type, with the checkpoint's values (q and k rows in llama.cpp's RoPE order, bfloat16
rounded as torch rounds, quantized experts within their block's step), the model's metadata and
tokenizer; the cached file is reused only while it is the checkpoint's, in those types."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from safetensors import safe_open  # noqa: E402

from bench.gguf_export import cached_gguf, convert, gguf_path, pair_rotary_rows  # noqa: E402
from common.arch import checkpoint_spec  # noqa: E402
from common.errors import CheckpointError  # noqa: E402


def read(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def values(t) -> np.ndarray:
    """A GGUF tensor as float32 in transformers' order (numpy's view of it is already that)."""
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


def source(ckpt) -> dict[str, torch.Tensor]:
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def experts(src: dict, layer: int, w: str, n: int) -> torch.Tensor:
    p = f"model.layers.{layer}.block_sparse_moe.experts."
    return torch.stack([src[f"{p}{e}.{w}.weight"] for e in range(n)])


@pytest.fixture(scope="module")
def mixtral(checkpoint, tmp_path_factory):
    ckpt = checkpoint("mixtral")
    out = tmp_path_factory.mktemp("gguf") / "m-f32.gguf"
    convert(ckpt, out, "f32", "f32")
    return ckpt, out


def test_every_tensor_has_llama_cpps_name_shape_and_type(mixtral, tmp_path) -> None:
    ckpt, _ = mixtral
    s = checkpoint_spec(ckpt)
    out = tmp_path / "m.gguf"
    convert(ckpt, out, "bf16", "q4_0")
    _, tensors = read(out)
    h, f, e, q, kv = s.hidden_size, s.expert_intermediate_size, s.num_experts, 64, 32
    want = {"token_embd.weight": ((h, 512), "BF16"), "output_norm.weight": ((h,), "F32")}
    want["output.weight"] = ((h, 512), "BF16")
    for i in range(s.num_layers):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": ((h,), "F32"),
            b + "attn_q.weight": ((h, q), "BF16"),
            b + "attn_k.weight": ((h, kv), "BF16"),
            b + "attn_v.weight": ((h, kv), "BF16"),
            b + "attn_output.weight": ((q, h), "BF16"),
            b + "ffn_norm.weight": ((h,), "F32"),
            b + "ffn_gate_inp.weight": ((h, e), "F32"),
            b + "ffn_gate_exps.weight": ((h, f, e), "Q4_0"),
            b + "ffn_up_exps.weight": ((h, f, e), "Q4_0"),
            b + "ffn_down_exps.weight": ((f, h, e), "Q4_0"),
        }
    # GGUF lists ggml's dimensions: transformers' reversed.
    got = {n: (tuple(int(d) for d in t.shape), t.tensor_type.name) for n, t in tensors.items()}
    assert got == want


def test_metadata_is_the_checkpoints_model(mixtral) -> None:
    ckpt, out = mixtral
    s = checkpoint_spec(ckpt)
    fields, _ = read(out)
    assert fields["general.architecture"] == "llama"
    expect = {
        "vocab_size": 512,
        "context_length": s.max_position_embeddings,
        "embedding_length": s.hidden_size,
        "block_count": s.num_layers,
        "feed_forward_length": s.expert_intermediate_size,
        "attention.head_count": s.num_heads,
        "attention.head_count_kv": s.num_kv_heads,
        "attention.key_length": s.head_dim,
        "rope.dimension_count": s.head_dim,
        "expert_count": s.num_experts,
        "expert_used_count": s.top_k,
    }
    assert {k: fields[f"llama.{k}"] for k in expect} == expect
    assert fields["llama.rope.freq_base"] == pytest.approx(s.rope_theta)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(s.rms_norm_eps)
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32


def test_the_tokenizer_is_the_checkpoints_bpe(mixtral) -> None:
    ckpt, out = mixtral
    fields, _ = read(out)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # the ByteLevel pre-tokenizer's regex
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 512 and all(vocab[t] == i for i, t in enumerate(tokens))
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in tok["model"]["merges"]]
    types = fields["tokenizer.ggml.token_type"]
    assert types[0] == types[1] == gguf.TokenType.CONTROL  # <|endoftext|>, <|pad|>
    assert set(types[4:]) == {gguf.TokenType.NORMAL}
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (0, 0)
    assert fields["tokenizer.ggml.add_bos_token"] is False


def test_float32_values_are_the_checkpoints(mixtral) -> None:
    ckpt, out = mixtral
    s, src = checkpoint_spec(ckpt), source(mixtral[0])
    _, t = read(out)
    p = "model.layers.1."
    assert np.array_equal(values(t["token_embd.weight"]), src["model.embed_tokens.weight"])
    assert np.array_equal(values(t["output.weight"]), src["lm_head.weight"])
    assert np.array_equal(values(t["blk.1.attn_v.weight"]), src[p + "self_attn.v_proj.weight"])
    assert np.array_equal(
        values(t["blk.1.ffn_gate_inp.weight"]), src[p + "block_sparse_moe.gate.weight"]
    )
    q = pair_rotary_rows(src[p + "self_attn.q_proj.weight"], s.num_heads)
    assert np.array_equal(values(t["blk.1.attn_q.weight"]), q)
    k = pair_rotary_rows(src[p + "self_attn.k_proj.weight"], s.num_kv_heads)
    assert np.array_equal(values(t["blk.1.attn_k.weight"]), k)
    for name, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        want = experts(src, 1, w, s.num_experts)
        assert np.array_equal(values(t[f"blk.1.ffn_{name}_exps.weight"]), want), name


def test_rotary_rows_pair_each_dimension_with_its_half_head_partner() -> None:
    heads, head_dim = 3, 8
    w = torch.arange(heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 2)
    out = pair_rotary_rows(w, heads)[:, 0].tolist()
    # llama.cpp rotates (2j, 2j+1); transformers (j, j + head_dim/2) within each head.
    assert out[:8] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert out[8:16] == [8 + x for x in out[:8]]


def test_bfloat16_rounds_as_torch_and_quantized_experts_stay_within_a_step(mixtral, tmp_path):
    ckpt, _ = mixtral
    src = source(ckpt)
    convert(ckpt, tmp_path / "q8.gguf", "bf16", "q8_0")
    convert(ckpt, tmp_path / "q4.gguf", "bf16", "q4_0")
    _, q8 = read(tmp_path / "q8.gguf")
    _, q4 = read(tmp_path / "q4.gguf")
    o = src["model.layers.0.self_attn.o_proj.weight"]
    assert np.array_equal(values(q8["blk.0.attn_output.weight"]), o.to(torch.bfloat16).float())
    want = experts(src, 0, "w2", 8).numpy()  # [experts, hidden, ffn]: blocks of 32 along ffn
    block_max = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
    # A step is the block's largest magnitude over 127 (q8_0) or 8 (q4_0). q8_0 rounds to the
    # nearest step; q4_0 clips the side opposite the largest value at 7 steps: one step off at
    # most. The scale is stored as float16: up to 127 (or 8) steps of 2^-11 relative more.
    for t, steps, bound in ((q8, 127, 0.5 + 127 / 2048), (q4, 8, 1 + 8 / 2048)):
        err = np.abs(values(t["blk.0.ffn_down_exps.weight"]) - want).reshape(-1, 32)
        assert (err <= block_max / steps * bound + 1e-7).all()
        assert err.max() > 0  # it did quantize


def test_fused_experts_convert_to_the_same_file_contents(checkpoint, mixtral, tmp_path):
    fused = checkpoint("mixtral", expert_layout="fused")
    convert(fused, tmp_path / "fused.gguf", "f32", "f32")
    _, a = read(tmp_path / "fused.gguf")
    _, b = read(mixtral[1])
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[n].data, b[n].data) for n in a)


def test_qwen3_moe_maps_to_qwen3moe_with_qk_norms_and_no_permutation(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe", overrides={"norm_topk_prob": True})
    s, out = checkpoint_spec(ckpt), tmp_path / "q.gguf"
    convert(ckpt, out, "f32", "f32")
    fields, t = read(out)
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_feed_forward_length"] == s.expert_intermediate_size
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
    assert np.array_equal(values(t["blk.0.attn_q.weight"]), q)  # halves, as llama.cpp rotates
    assert np.array_equal(values(t["blk.0.attn_q_norm.weight"]), norm)


@pytest.mark.parametrize(
    ("arch", "overrides", "reason"),
    [
        ("olmoe", None, "family olmoe"),
        ("qwen3_moe", None, "renormalised"),  # norm_topk_prob off: llama.cpp renormalises
    ],
)
def test_a_model_llama_cpp_would_compute_differently_is_refused(
    checkpoint, tmp_path, arch, overrides, reason
) -> None:
    ckpt = checkpoint(arch, **({"overrides": overrides} if overrides else {}))
    with pytest.raises(CheckpointError, match=reason):
        convert(ckpt, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_the_cached_file_is_reused_and_rebuilt_when_stale_or_corrupt(checkpoint, tmp_path, capsys):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint("mixtral"), ckpt)
    out = cached_gguf(ckpt, "bf16", "q8_0")
    assert out == gguf_path(ckpt, "bf16", "q8_0") == tmp_path / "ckpt-bf16-q8_0.gguf"
    stamp = out.stat().st_mtime_ns
    assert cached_gguf(ckpt, "bf16", "q8_0").stat().st_mtime_ns == stamp  # reused
    capsys.readouterr()

    config = json.loads((ckpt / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # another checkpoint: its fingerprint differs
    (ckpt / "config.json").write_text(json.dumps(config))
    cached_gguf(ckpt, "bf16", "q8_0")
    assert "converting again" in capsys.readouterr().err
    fields, _ = read(out)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)

    with open(out, "r+b") as f:  # truncated mid-tensor
        f.truncate(os.path.getsize(out) // 2)
    cached_gguf(ckpt, "bf16", "q8_0")
    assert "unreadable: converting again" in capsys.readouterr().err
    read(out)  # whole again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt-bf16-q8_0.gguf"]
