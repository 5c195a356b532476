"""DBRX: its nested config, its own tensor layout (fused Wqkv, experts as [experts * inter, hidden]
matrices), the p-norm router and combine order, and errors that name the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DbrxConfig
from transformers.models.dbrx.modeling_dbrx import DbrxFFN

from common.arch import parse_spec
from common.checkpoint import Checkpoint
from common.errors import CheckpointError, UnsupportedModelError
from common.moe import combine, expert_ffn, group_by_expert, route
from common.safetensors_mmap import SafetensorsFile
from tests.support.hf import load

# What published DBRX checkpoints carry (dbrx-instruct's config.json at reduced sizes): written
# before transformers 5, so no rope_parameters, the RoPE base in attn_config, no norm setting.
PUBLISHED = {
    "architectures": ["DbrxForCausalLM"],
    "model_type": "dbrx",
    "d_model": 64,
    "n_heads": 4,
    "n_layers": 2,
    "max_seq_len": 256,
    "vocab_size": 100,
    "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "model_type": "", "rope_theta": 500000},
    "ffn_config": {
        "ffn_hidden_size": 32,
        "moe_jitter_eps": 0.01,
        "moe_loss_weight": 0.05,
        "moe_num_experts": 16,
        "moe_top_k": 4,
        "model_type": "",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _published(**edits) -> dict:
    config = json.loads(json.dumps(PUBLISHED))
    for path, value in edits.items():
        *parents, key = path.split("__")
        node = config
        for p in parents:
            node = node[p]
        if value is ...:
            node.pop(key)
        else:
            node[key] = value
    return config


def test_published_config() -> None:
    s = parse_spec(PUBLISHED)
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads) == (64, 2, 4, 2)
    assert (s.head_dim, s.num_experts, s.top_k, s.expert_intermediate_size) == (16, 16, 4, 32)
    assert (s.norm, s.rms_norm_eps, s.router, s.router_pnorm) == ("layer", 1e-5, "softmax_pnorm", 1)
    assert (s.clip_qkv, s.rope_theta, s.max_position_embeddings) == (8.0, 500000.0, 256)
    assert (s.activation.kind, s.torch_dtype, s.moe_layer_ids) == ("silu", "bfloat16", [0, 1])
    assert s.expert_params == 3 * 64 * 32


def test_config_variants() -> None:
    # transformers 5 writes the base in rope_parameters, and reads it only there.
    v5 = _published(rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    assert parse_spec(v5).rope_theta == 1234.0
    assert parse_spec(_published(attn_config__rope_theta=...)).rope_theta == 10000.0
    for pnorm, want in ((None, None), (2, 2.0)):
        config = _published(ffn_config__moe_normalize_expert_weights=pnorm)
        assert parse_spec(config).router_pnorm == want
    assert parse_spec(_published(attn_config__clip_qkv=None)).clip_qkv is None
    gelu = _published(ffn_config__ffn_act_fn={"name": "gelu"})
    assert parse_spec(gelu).activation.kind == "gelu"


@pytest.mark.parametrize(
    ("edits", "error", "message"),
    [
        ({"d_model": ...}, CheckpointError, "missing config field 'd_model'"),
        ({"ffn_config": ...}, CheckpointError, "missing config field 'ffn_config'"),
        ({"ffn_config__moe_top_k": ...}, CheckpointError, "'ffn_config.moe_top_k'"),
        ({"ffn_config__ffn_hidden_size": None}, CheckpointError, "'ffn_config.ffn_hidden_size'"),
        ({"attn_config__kv_n_heads": ...}, CheckpointError, "'attn_config.kv_n_heads'"),
        ({"ffn_config__moe_top_k": 17}, CheckpointError, "ffn_config.moe_top_k=17 exceeds"),
        ({"n_heads": 5}, CheckpointError, "d_model=64 is not a multiple of n_heads=5"),
        ({"tie_word_embeddings": True}, UnsupportedModelError, "tie_word_embeddings"),
        (
            {"ffn_config__ffn_act_fn": {"name": "relu"}},
            UnsupportedModelError,
            "ffn_config.ffn_act_fn name='relu'",
        ),
    ],
)
def test_bad_configs_name_the_field_and_file(edits, error, message) -> None:
    with pytest.raises(error, match=message) as e:
        parse_spec(_published(**edits), "ckpt/config.json")
    assert "ckpt/config.json" in str(e.value)


# -- loading -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load(checkpoint("dbrx"))


def test_layers_and_experts_are_transformers_weights(checkpoint, hf_model) -> None:
    ckpt = Checkpoint(checkpoint("dbrx"))
    s, t = ckpt.spec, hf_model.transformer
    dense = ckpt.load_dense()
    assert torch.equal(dense.embed, t.wte.weight) and torch.equal(dense.final_norm, t.norm_f.weight)
    assert torch.equal(dense.lm_head, hf_model.lm_head.weight)
    for i, block in enumerate(t.blocks):
        ours, attn = dense.layers[i], block.norm_attn_norm
        assert torch.equal(ours.input_norm, attn.norm_1.weight)
        assert torch.equal(ours.post_attention_norm, attn.norm_2.weight)
        assert torch.equal(ours.attention.qkv, attn.attn.Wqkv.weight)
        assert torch.equal(ours.attention.o, attn.attn.out_proj.weight)
        assert torch.equal(ours.router, block.ffn.router.layer.weight)
    i, h = s.expert_intermediate_size, s.hidden_size
    experts = ckpt.load_experts([(0, 0), (2, 5), (2, 7)])
    for (layer, e), w in experts.items():
        mlp = t.blocks[layer].ffn.experts.mlp
        w1, v1, w2 = (m.view(-1, i, h)[e] for m in (mlp.w1, mlp.v1, mlp.w2))
        assert torch.equal(w.gate_up, torch.cat([w1, v1])) and torch.equal(w.down, w2.T)
        x = torch.randn(3, h)
        want = (torch.nn.functional.silu(x @ w1.T) * (x @ v1.T)) @ w2  # transformers' DbrxExpertGLU
        assert torch.allclose(expert_ffn(x, w), want, atol=1e-6)


def test_an_expert_reads_its_layers_expert_tensors_only(checkpoint, monkeypatch) -> None:
    touched: list[str] = []
    original = SafetensorsFile.get
    monkeypatch.setattr(
        SafetensorsFile, "get", lambda self, name: touched.append(name) or original(self, name)
    )
    ckpt = Checkpoint(checkpoint("dbrx"), dtype=torch.bfloat16)
    [w] = ckpt.load_experts([(1, 3)]).values()
    base = "transformer.blocks.1.ffn.experts.mlp."
    assert sorted(set(touched)) == [base + "v1", base + "w1", base + "w2"]
    # Sliced before the conversion: one expert's bytes, not the layer's.
    assert w.nbytes == ckpt.spec.expert_params * 2 and w.down.dtype == torch.bfloat16
    touched.clear()
    ckpt.load_dense()
    assert touched and not any("experts" in n for n in touched)


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("dbrx"), dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("name", "replacement", "message"),
    [
        ("transformer.blocks.2.ffn.experts.mlp.w2", None, "missing tensor"),
        ("transformer.blocks.0.ffn.experts.mlp.v1", torch.zeros(8 * 96, 32), "[768, 32]"),
        ("transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight", torch.zeros(64, 64), "[128, 64]"),
        ("transformer.norm_f.weight", None, "missing tensor"),
        ("transformer.blocks.0.ffn.router.layer.weight", torch.zeros(7, 64), "[8, 64]"),
    ],
)
def test_broken_checkpoint_names_file_and_tensor(broken, name, replacement, message) -> None:
    _rewrite(
        broken, lambda t: t.pop(name) if replacement is None else t.update({name: replacement})
    )
    with pytest.raises(CheckpointError) as e:  # a wrong shape already when opened: the headers
        ckpt = Checkpoint(broken)
        ckpt.load_dense()
        ckpt.load_experts(ckpt.all_expert_pairs())
    assert message in str(e.value) and repr(name) in str(e.value) and str(broken) in str(e.value)


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pnorm", [1.0, 2.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_and_combine_are_transformers_bit_for_bit(pnorm, dtype) -> None:
    """Weights: softmax in the hidden dtype, top-4 of 16, over their p-norm. Combine: each weighted
    output added to the running sum in the hidden dtype, experts ascending, as DbrxExperts does."""
    torch.manual_seed(0)
    ffn_config = {"ffn_hidden_size": 16, "moe_num_experts": 16, "moe_top_k": 4}
    ffn_config["moe_normalize_expert_weights"] = pnorm
    config = DbrxConfig(
        d_model=32, n_heads=4, n_layers=1, attn_config={"rope_theta": 1e4}, ffn_config=ffn_config
    )
    hf = DbrxFFN(config).to(dtype)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    spec = parse_spec(config.to_dict())
    x = torch.randn(40, 32, dtype=dtype)
    routing = route(x, hf.router.layer.weight, spec)
    want_w, want_e = hf.route_tokens_to_experts(hf.router(x))
    order = want_e.sort(dim=-1)
    assert torch.equal(routing.experts, order.values)
    assert torch.equal(routing.weights, want_w.gather(1, order.indices))
    # Expert outputs that do not depend on which rows share a GEMM, so that both sides get the
    # same bits and only routing and combine are compared (transformers' own combine loop).
    hf.experts.mlp.forward = lambda rows, w1, v1, w2: rows * w1[0]
    groups = group_by_expert(routing, 16)
    w1 = hf.experts.mlp.w1.view(16, 16, 32)
    outputs = [x[g.tokens] * w1[g.expert, 0] for g in groups]
    with torch.no_grad():
        want = hf(x[None])[0]
    assert torch.equal(combine(groups, outputs, routing, len(x), like=x), want)
