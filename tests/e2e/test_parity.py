"""Parity with HuggingFace transformers on the same checkpoint: logits within 1e-4, identical greedy tokens."""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from common.checkpoint import Checkpoint
from common.sampling import SamplingParams
from router_service.build import build_local_engine, build_model
from router_service.engine.engine import FinishReason
from router_service.engine.model import pack_step
from router_service.settings import RouterSettings
from tests.support.hf import greedy_tokens

PROMPTS = [[7], [11, 3, 250, 9, 31], list(range(40, 53)), [(i * 37) % 400 + 5 for i in range(29)]]
NEW_TOKENS = 32
TOL = 1e-4
BLOCK = 4  # KV-cache block size: small, so the prompts span several blocks

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}
# (arch, create kwargs): the presets, plus configurations beyond them.
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
    "mixtral-top1": ("mixtral", {"overrides": {"num_experts_per_tok": 1}}),
    "mixtral-3experts-top3": (
        "mixtral",
        {"overrides": {"num_local_experts": 3, "num_experts_per_tok": 3}},
    ),
    "qwen2-5experts-top3": (
        "qwen2_moe",
        {"overrides": {"num_experts": 5, "num_experts_per_tok": 3}},
    ),
    "qwen2-dense-layers": (
        "qwen2_moe",
        {"overrides": {"mlp_only_layers": [0], "decoder_sparse_step": 2, "norm_topk_prob": True}},
    ),
    "qwen3-7experts-top3-norm": (
        "qwen3_moe",
        {"overrides": {"num_experts": 7, "num_experts_per_tok": 3, "norm_topk_prob": True}},
    ),
    "olmoe-clip-norm-tied": (
        "olmoe",
        {"overrides": {"clip_qkv": 0.5, "norm_topk_prob": True, "tie_word_embeddings": True}},
    ),
    # head_dim 32 != hidden 64 / 4 heads: q is 128 wide, twice the hidden size (Qwen3's q/k norm
    # spans one head; OLMoE cannot: transformers sizes its q norm by hidden_size).
    "mixtral-head-dim-32": ("mixtral", {"overrides": {"head_dim": 32}}),
    "qwen2-head-dim-32": ("qwen2_moe", {"overrides": {"head_dim": 32}}),
    "qwen3-head-dim-32": ("qwen3_moe", {"overrides": {"head_dim": 32}}),
    "mixtral-fused": ("mixtral", {"expert_layout": "fused"}),
    "qwen2-fused-sharded": ("qwen2_moe", {"expert_layout": "fused", "max_shard_size": "100KB"}),
    # The preset: 4 groups of 2 experts, the best 2 groups compete, q_lora, interleaved rope.
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek-3groups-top1-unnormalised": (
        "deepseek_v3",
        {
            "overrides": {
                "n_routed_experts": 12,
                "n_group": 3,
                "topk_group": 1,
                "num_experts_per_tok": 3,
                "norm_topk_prob": False,
                "routed_scaling_factor": 1.5,
            }
        },
    ),
    "deepseek-dense-first-fused-sharded": (
        "deepseek_v3",
        {
            "overrides": {"first_k_dense_replace": 1},
            "expert_layout": "fused",
            "max_shard_size": "100KB",
        },
    ),
    # A plain q_proj; biases on kv_a and o; the latent norms keep eps 1e-6 whatever rms_norm_eps says.
    "deepseek-q-proj-bias-eps": (
        "deepseek_v3",
        {"overrides": {"q_lora_rank": None, "attention_bias": True, "rms_norm_eps": 1e-5}},
    ),
    # YaRN as DeepSeek-V3 configures it (mscale = mscale_all_dim = 1: the softmax scale grows).
    "deepseek-yarn": (
        "deepseek_v3",
        {"overrides": {"rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}},
    ),
    # Plain YaRN (cos/sin scaled by its attention factor), rope in halves rather than pairs.
    "deepseek-yarn-halves": (
        "deepseek_v3",
        {"overrides": {"rope_parameters": _YARN, "rope_interleave": False}},
    ),
    # DBRX's preset: GQA 4/2, clip_qkv 8 (never reached at this width), weights over their 1-norm.
    # It cannot tie its embeddings (transformers' DbrxConfig refuses), so every case is untied.
    "dbrx": ("dbrx", {}),
    "dbrx-16experts-top4": (
        "dbrx",
        {"overrides": {"ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}},
    ),
    # clip_qkv 0.2 clamps ~15% of the q/k/v values; one kv head for all four query heads.
    "dbrx-clip-pnorm2-mqa": (
        "dbrx",
        {
            "overrides": {
                "attn_config": {"clip_qkv": 0.2, "kv_n_heads": 1},
                "ffn_config": {"moe_normalize_expert_weights": 2.0},
            }
        },
    ),
    # (clip_qkv null is no reference: transformers 5.23's DbrxAttention calls clamp(None, None).)
    "dbrx-unnormalised-gelu-mha-sharded": (
        "dbrx",
        {
            "overrides": {
                "attn_config": {"kv_n_heads": 4},
                "ffn_config": {
                    "moe_normalize_expert_weights": None,
                    "ffn_act_fn": {"name": "gelu"},
                },
            },
            "max_shard_size": "100KB",
        },
    ),
    # gpt-oss's preset slides a 16-token window over even layers, with yarn and attention biases.
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss-window5-full-first-5experts-top3": (
        "gpt_oss",
        {
            "overrides": {
                "sliding_window": 5,  # shorter than 3 of the 4 prompts, not a multiple of BLOCK
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                "num_local_experts": 5,
                "num_experts_per_tok": 3,
            }
        },
    ),
    "gpt_oss-no-bias-no-yarn-head-dim-32": (
        "gpt_oss",
        {
            "overrides": {
                "attention_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
                "head_dim": 32,
            }
        },
    ),
    "gpt_oss-mxfp4-sharded": ("gpt_oss", {"quantize": "mxfp4", "max_shard_size": "100KB"}),
    # GLM-4.5 (every glm4_moe checkpoint we create has a non-zero e_score_correction_bias): the
    # preset has q/k norm, q/k/v bias, half rotary, one group, first layer dense, scaling 2.5.
    "glm4_moe": ("glm4_moe", {}),
    "glm4-4groups-top2-nonorm-dense2-rotary-quarter": (
        "glm4_moe",
        {
            "overrides": {
                "n_group": 4,
                "topk_group": 2,
                "norm_topk_prob": False,
                "first_k_dense_replace": 2,
                "partial_rotary_factor": 0.25,
            }
        },
    ),
    "glm4-no-qknorm-no-bias-2groups-top3-all-moe": (
        "glm4_moe",
        {
            "overrides": {
                "use_qk_norm": False,
                "attention_bias": False,
                "n_group": 2,
                "topk_group": 1,
                "num_experts_per_tok": 3,
                "first_k_dense_replace": 0,
                "routed_scaling_factor": 1.0,
                "partial_rotary_factor": 0.75,
            }
        },
    ),
    "glm4-fused-yarn-full-rotary": (
        "glm4_moe",
        {
            "expert_layout": "fused",
            "overrides": {
                "partial_rotary_factor": 1.0,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            },
        },
    ),
}


@cache
def _hf(path: Path):
    # MXFP4 experts: transformers dequantizes them at load, on CPU (no kernels here).
    quantized = "quantization_config" in (path / "config.json").read_text()
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return model.eval()


@cache
def _hf_greedy(path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_tokens(_hf(path), prompt, n)


@pytest.fixture(params=list(CASES), scope="module")
def case(request, checkpoint) -> Path:
    arch, kwargs = CASES[request.param]
    return checkpoint(arch, **kwargs)


def test_logits_match_transformers_prefill_and_decode(case: Path) -> None:
    """Prompts of different lengths packed into one prefill, then decode steps with teacher forcing."""
    model = build_model(Checkpoint(case), RouterSettings())
    per_seq = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // BLOCK)
    cache_ = model.new_cache(len(PROMPTS) * per_seq, BLOCK)
    # Each sequence's blocks interleaved with the others': tables need not be contiguous.
    tables = [list(range(i, len(PROMPTS) * per_seq, len(PROMPTS))) for i in range(len(PROMPTS))]
    batch = pack_step([(t, 0, p) for t, p in zip(tables, PROMPTS)], [], BLOCK)
    ours = asyncio.run(model.forward(batch, cache_, all_logits=True))  # [tokens, vocab]
    hf = _hf(case)
    row = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours[row : row + len(prompt)] - ref).abs().max().item() <= TOL
        row += len(prompt)

    continuations = [_hf_greedy(case, tuple(p), 8) for p in PROMPTS]
    for step in range(8):
        decodes = [
            (table, cont[step], len(p) + step + 1)
            for table, p, cont in zip(tables, PROMPTS, continuations)
        ]
        logits = asyncio.run(model.forward(pack_step([], decodes, BLOCK), cache_))
        for slot, (p, cont) in enumerate(zip(PROMPTS, continuations)):
            with torch.no_grad():
                ref = hf(torch.tensor([p + cont[: step + 1]])).logits[0, -1]
            assert (logits[slot] - ref).abs().max().item() <= TOL, (
                f"decode step {step}, prompt {slot}"
            )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_greedy_generation_matches_transformers_with_joins_and_leaves(case: Path) -> None:
    """Requests join mid-way and leave early (slot compaction); every sequence still matches transformers."""
    engine = build_local_engine(RouterSettings(checkpoint=case))
    plan = {
        0: [(0, NEW_TOKENS), (1, 6)],
        3: [(2, NEW_TOKENS)],
        9: [(3, 10)],
    }  # step -> [(prompt, max_tokens)]
    got: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason | None] = {}
    lengths: dict[str, int] = {}
    seen_batch_sizes = set()

    async def drive() -> None:
        step = 0
        while step <= max(plan) or engine.has_unfinished():
            for i, n in plan.get(step, []):
                engine.add_request(str(i), PROMPTS[i], _greedy(n))
                lengths[str(i)] = n
            seen_batch_sizes.add(len(engine.running))
            for out in await engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                reasons[out.request_id] = out.finish_reason
            step += 1

    asyncio.run(drive())
    assert max(seen_batch_sizes) >= 3
    for rid, n in lengths.items():
        want = _hf_greedy(case, tuple(PROMPTS[int(rid)]), NEW_TOKENS)[
            :n
        ]  # transformers' first n = the whole request
        assert (got[rid], reasons[rid]) == (want, FinishReason.LENGTH) and len(want) == n, (
            f"request {rid}"
        )
