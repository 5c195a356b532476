"""moe_mesh.dev.create_checkpoint: transformers must load what we write, bit-exactly and deterministically."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from moe_mesh.dev.create_checkpoint import ARCHS, add_subcommand, create_checkpoint
from tests.support.factories import make_checkpoint
from tests.support.hf import load, moe_blocks, top2_share_per_layer

# Family-specific config.json keys for the tiny preset (expert count, expert width, dense/shared widths).
TINY_FIELDS = {
    "mixtral": {"num_local_experts": 8, "intermediate_size": 96, "head_dim": 16},
    "qwen2_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 96,
        "intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 96,
        "intermediate_size": 128,
        "head_dim": 16,
    },
    "olmoe": {"num_experts": 8, "intermediate_size": 96},
    "deepseek_v3": {
        "n_routed_experts": 8,
        "moe_intermediate_size": 96,
        "intermediate_size": 128,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
        "num_key_value_heads": 4,  # latent attention: every head expands its own keys
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
    },
    "dbrx": {
        "ffn_config.moe_num_experts": 8,
        "ffn_config.ffn_hidden_size": 96,
        "attn_config.kv_n_heads": 2,
        "attn_config.clip_qkv": 8.0,
    },
    "gpt_oss": {
        "num_local_experts": 8,
        "intermediate_size": 96,
        "head_dim": 16,
        "sliding_window": 16,
    },
    "glm4_moe": {
        "n_routed_experts": 8,
        "moe_intermediate_size": 96,
        "intermediate_size": 128,
        "head_dim": 16,
        "first_k_dense_replace": 1,
    },
}
# DBRX spells the common fields its own way (dotted: a field of a nested sub-config).
SPELLING = {
    "dbrx": {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_experts_per_tok": "ffn_config.moe_top_k",
        "max_position_embeddings": "max_seq_len",
    }
}
FUSABLE = [a for a in ARCHS if a not in ("dbrx", "gpt_oss")]  # their own layouts are fused already
FOREIGN_KEYS = {
    "mixtral": {"moe_intermediate_size", "num_experts", "shared_expert_intermediate_size"},
    "olmoe": {
        "moe_intermediate_size",
        "num_local_experts",
        "head_dim",
        "shared_expert_intermediate_size",
    },
    "qwen2_moe": {"num_local_experts", "head_dim"},
    "qwen3_moe": {"num_local_experts", "shared_expert_intermediate_size"},
    "deepseek_v3": {"num_experts", "num_local_experts", "shared_expert_intermediate_size"},
    "dbrx": {"hidden_size", "num_experts", "num_local_experts", "intermediate_size", "head_dim"},
    "gpt_oss": {"num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"},
    "glm4_moe": {"num_experts", "num_local_experts", "shared_expert_intermediate_size"},
}
PROMPT = torch.tensor([[5, 17, 300, 42, 99, 7, 256, 3, 1, 480, 64, 12]])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter failure output
    yield
    hf_logging.enable_progress_bar()


def logits(path: Path) -> torch.Tensor:
    model = load(path)
    with torch.no_grad():
        # from_pretrained keeps tensors memory-mapped at file-dependent offsets, and CPU matmul kernels can differ
        # in the last bit with alignment; fresh allocations make equal weights give bit-equal logits.
        for param in model.parameters():
            param.data = param.data.clone()
        return model(input_ids=PROMPT).logits


def field(config: dict, arch: str, key: str):
    for part in SPELLING.get(arch, {}).get(key, key).split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def tensor_keys(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: (file.name, tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_loads_in_transformers(root: Path, arch: str) -> None:
    path = make_checkpoint(root, arch)
    config = json.loads((path / "config.json").read_text())
    expected = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
        "dtype": "float32",
        **TINY_FIELDS[arch],
    }
    assert {k: field(config, arch, k) for k in expected} == expected
    assert not FOREIGN_KEYS[arch] & config.keys()

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.is_fast and tok.eos_token == "<|endoftext|>"
    assert config["vocab_size"] == len(tok) and 400 <= len(tok) <= 600
    assert 0 <= config["eos_token_id"] == tok.eos_token_id < config["vocab_size"]
    assert config["pad_token_id"] == tok.pad_token_id != config["eos_token_id"]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    text = "héllo wörld — 你好 👋"
    assert tok.decode(tok(text)["input_ids"]) == text

    model = load(path)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    out = model.generate(
        input_ids=PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
    )
    new = out[0, PROMPT.shape[1] :].tolist()
    assert (
        len(new) == 12 and len(set(new)) > 1
    )  # random weights still give input-dependent, non-constant output


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes(tmp_path: Path, arch: str) -> None:
    a, b, c = (
        create_checkpoint(tmp_path / n, arch, seed=s, router_skew=2.0)
        for n, s in (("a", 3), ("b", 3), ("c", 4))
    )
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", FUSABLE)
@pytest.mark.parametrize("shard", [None, "150KB"])
def test_fused_layout_matches_per_expert(root: Path, arch: str, shard: str | None) -> None:
    per_expert = make_checkpoint(root, arch, seed=1, max_shard_size=shard)
    fused = make_checkpoint(root, arch, seed=1, max_shard_size=shard, expert_layout="fused")
    keys = tensor_keys(fused)
    assert not any(".experts.0." in k or "block_sparse_moe" in k for k in keys)
    dense = {layer for layer in range(3) if f"model.layers.{layer}.mlp.gate_proj.weight" in keys}
    for layer in sorted({0, 1, 2} - dense):  # GLM's first layer is dense
        assert keys[f"model.layers.{layer}.mlp.experts.gate_up_proj"][1] == (8, 2 * 96, 64)
        assert keys[f"model.layers.{layer}.mlp.experts.down_proj"][1] == (8, 64, 96)
    if shard:
        index = json.loads((fused / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {k: f for k, (f, _) in keys.items()}
        shards = sorted(
            p.name for p in fused.glob("*.safetensors")
        )  # no empty leftovers, numbering consistent
        assert shards == sorted(set(index["weight_map"].values())) and len(shards) > 1
        assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)

    # Check the packing directly (gate rows first), not only through transformers' own loader.
    gate, up, down = (
        ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    prefix = "model.layers.2.block_sparse_moe" if arch == "mixtral" else "model.layers.2.mlp"
    old = {k: f for k, (f, _) in tensor_keys(per_expert).items()}
    new_key = "model.layers.2.mlp.experts."
    with safe_open(fused / keys[new_key + "gate_up_proj"][0], "pt") as f:
        gate_up, down_proj = (
            f.get_tensor(new_key + "gate_up_proj"),
            f.get_tensor(new_key + "down_proj"),
        )
    for name, expected in ((gate, gate_up[5, :96]), (up, gate_up[5, 96:]), (down, down_proj[5])):
        key = f"{prefix}.experts.5.{name}.weight"
        with safe_open(per_expert / old[key], "pt") as f:
            assert torch.equal(f.get_tensor(key), expected), key

    fused_state, per_expert_state = load(fused).state_dict(), load(per_expert).state_dict()
    assert fused_state.keys() == per_expert_state.keys()
    assert all(torch.equal(fused_state[k], per_expert_state[k]) for k in fused_state)
    assert torch.equal(logits(fused), logits(per_expert))


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint(root: Path, arch: str) -> None:
    sharded = make_checkpoint(root, arch, seed=2, max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in sharded.glob("*.safetensors"))
    assert torch.equal(logits(sharded), logits(make_checkpoint(root, arch, seed=2)))


@pytest.mark.parametrize("arch", ARCHS)
def test_router_skew(root: Path, arch: str) -> None:
    uniform = top2_share_per_layer(make_checkpoint(root, arch, seed=5))
    skewed_path = make_checkpoint(root, arch, seed=5, router_skew=4.0)
    skewed = top2_share_per_layer(skewed_path)
    assert (
        max(uniform) < 0.45 and sum(uniform) / len(uniform) < 0.4
    )  # 2 of 8 experts: 0.25 if perfectly even
    assert min(skewed) > 0.55
    # Each layer gets its own hot experts, like real traffic.
    model = load(skewed_path)
    hot = {
        tuple(gate.weight[:, 0].topk(2).indices.sort().values.tolist())
        for _, _, gate in moe_blocks(model)
    }
    assert len(hot) > 1


@pytest.mark.parametrize(
    ("arch", "overrides", "check"),
    [
        ("mixtral", {"num_local_experts": 5}, {"num_local_experts": 5}),
        (
            "mixtral",
            {"num_experts": 5},
            {"num_local_experts": 5},
        ),  # alias resolves to the canonical field
        ("olmoe", {"num_experts": 5, "clip_qkv": 0.5}, {"num_experts": 5, "clip_qkv": 0.5}),
        (
            "qwen3_moe",
            {"num_experts": 5, "num_experts_per_tok": 1},
            {"num_experts": 5, "num_experts_per_tok": 1},
        ),
        (
            "qwen2_moe",
            {"norm_topk_prob": True, "tie_word_embeddings": True},
            {"norm_topk_prob": True},
        ),
        ("qwen2_moe", {"mlp_only_layers": [1], "decoder_sparse_step": 1}, {"mlp_only_layers": [1]}),
        ("qwen3_moe", {"mlp_only_layers": [1], "decoder_sparse_step": 1}, {"mlp_only_layers": [1]}),
        (
            "deepseek_v3",
            {"num_local_experts": 6, "n_group": 3, "topk_group": 1, "q_lora_rank": None},
            {"n_routed_experts": 6, "n_group": 3, "q_lora_rank": None},
        ),
    ],
)
def test_overrides(root: Path, arch: str, overrides: dict, check: dict) -> None:
    path = make_checkpoint(root, arch, overrides=overrides, router_skew=2.0, expert_layout="fused")
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in check} == check
    keys = tensor_keys(path)
    if "mlp_only_layers" in overrides:
        assert (
            "model.layers.1.mlp.experts.gate_up_proj" not in keys
            and "model.layers.1.mlp.gate_proj.weight" in keys
        )
    if overrides.get("tie_word_embeddings"):
        assert "lm_head.weight" not in keys
    experts = (
        config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    )
    assert keys["model.layers.0.mlp.experts.down_proj"][1][0] == experts
    with torch.no_grad():
        assert torch.isfinite(load(path)(input_ids=PROMPT).logits).all()


def test_dbrx_overrides_merge_into_its_sub_configs(root: Path) -> None:
    overrides = {
        "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4},
        "attn_config": {"clip_qkv": 0.5},
        "hidden_size": 32,  # its attribute_map alias of d_model
    }
    path = make_checkpoint(root, "dbrx", overrides=overrides, router_skew=2.0)
    config = json.loads((path / "config.json").read_text())
    assert config["d_model"] == 32 and "hidden_size" not in config
    ffn = config["ffn_config"]
    # ffn_hidden_size and kv_n_heads: the preset's, kept
    assert (ffn["moe_num_experts"], ffn["moe_top_k"], ffn["ffn_hidden_size"]) == (16, 4, 96)
    assert (config["attn_config"]["clip_qkv"], config["attn_config"]["kv_n_heads"]) == (0.5, 2)
    keys = tensor_keys(path)
    assert keys["transformer.blocks.2.ffn.experts.mlp.w2"][1] == (16 * 96, 32)
    with torch.no_grad():
        assert torch.isfinite(load(path)(input_ids=PROMPT).logits).all()


def test_gpt_oss_biases_and_sinks_are_not_transformers_zeros(root: Path) -> None:
    model = load(make_checkpoint(root, "gpt_oss", overrides={"attention_bias": True}))
    params = dict(model.model.layers[1].named_parameters())
    assert params["self_attn.sinks"].abs().max() > 0.5  # of order one, as trained ones are
    for name in ("self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.experts.gate_up_proj_bias"):
        assert params[name].abs().min() > 0, name


def test_gpt_oss_mxfp4_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = tmp_path / "mxfp4"
    argv = ["--arch", "gpt_oss", "--out", str(out), "--quantize", "mxfp4", "--router-skew", "2"]
    assert run_cli("checkpoint", "create", *argv, "--max-shard-size", "150KB") == 0
    keys = tensor_keys(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: f for k, (f, _) in keys.items()}
    experts = "model.layers.0.mlp.experts."
    assert keys[experts + "gate_up_proj_blocks"][1] == (8, 192, 2, 16)
    assert keys[experts + "down_proj_scales"][1] == (8, 64, 3)
    assert experts + "gate_up_proj" not in keys and experts + "gate_up_proj_bias" in keys
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    model, info = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=Mxfp4Config(dequantize=True), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=PROMPT).logits).all()


def test_gpt_oss_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only gpt_oss"):
        create_checkpoint(tmp_path / "x", "mixtral", quantize="mxfp4")
    with pytest.raises(ValueError, match="quantize='int4'"):
        create_checkpoint(tmp_path / "x", "gpt_oss", quantize="int4")
    with pytest.raises(ValueError, match="fused already"):
        create_checkpoint(tmp_path / "x", "gpt_oss", expert_layout="fused")
    with pytest.raises(ValueError, match="multiples of 32, not 64 and 80"):
        create_checkpoint(
            tmp_path / "x", "gpt_oss", quantize="mxfp4", overrides={"intermediate_size": 80}
        )
    assert not (tmp_path / "x").exists()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mixtral, qwen2_moe, qwen3_moe, olmoe"):
        create_checkpoint(tmp_path / "x", "llama")
    with pytest.raises(ValueError, match="tiny, small"):
        create_checkpoint(tmp_path / "x", "olmoe", "huge")
    with pytest.raises(ValueError, match="per_expert, fused"):
        create_checkpoint(tmp_path / "x", "olmoe", expert_layout="stacked")
    with pytest.raises(ValueError, match="fused already"):
        create_checkpoint(tmp_path / "x", "dbrx", expert_layout="fused")
    assert not (tmp_path / "x").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        create_checkpoint(tmp_path / "busy", "olmoe")
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot create output directory .*file is not a writable"):
        create_checkpoint(tmp_path / "file" / "sub", "olmoe")
    (tmp_path / "empty").mkdir()
    assert (create_checkpoint(tmp_path / "empty", "olmoe") / "config.json").exists()


def test_quiet_unless_progress(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    hf_logging.enable_progress_bar()  # the user's setting, which a quiet call must leave as it was
    try:
        create_checkpoint(tmp_path / "quiet", "mixtral", max_shard_size="300KB")
        assert capfd.readouterr() == ("", "")
        assert hf_logging.is_progress_bar_enabled()
        create_checkpoint(tmp_path / "loud", "mixtral", expert_layout="fused", progress=True)
        err = capfd.readouterr().err
        assert (
            "initialising MixtralForCausalLM" in err
            and "Writing model shards" in err
            and "Fusing experts" in err
        )
    finally:
        hf_logging.disable_progress_bar()


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="moe-mesh")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_create(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    rc = run_cli(
        "checkpoint",
        "create",
        "--arch",
        "qwen2_moe",
        "--preset",
        "tiny",
        "--out",
        str(out),
        "--seed",
        "7",
        "--router-skew",
        "3",
        "--expert-layout",
        "fused",
        "--max-shard-size",
        "300KB",
        "--override",
        "num_experts_per_tok=1",
        "--override",
        "mlp_only_layers=[2]",
    )
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_experts_per_tok"], config["mlp_only_layers"]) == (1, [2])
    assert (out / "model.safetensors.index.json").exists()
    load(out)
    expected = create_checkpoint(
        tmp_path / "api",
        "qwen2_moe",
        seed=7,
        router_skew=3.0,
        expert_layout="fused",
        max_shard_size=300_000,
        overrides={"num_experts_per_tok": 1, "mlp_only_layers": [2]},
    )
    assert (expected / "config.json").read_bytes() == (out / "config.json").read_bytes()


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("x")
    assert run_cli("checkpoint", "create", "--arch", "olmoe", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and "not empty" in err and str(tmp_path) in err

    with pytest.raises(SystemExit) as exc:
        run_cli("checkpoint", "create", "--arch", "llama", "--out", str(tmp_path / "new"))
    assert exc.value.code == 2 and "invalid choice: 'llama'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run_cli(
            "checkpoint",
            "create",
            "--arch",
            "olmoe",
            "--out",
            str(tmp_path / "new"),
            "--override",
            "oops",
        )
    assert exc.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
