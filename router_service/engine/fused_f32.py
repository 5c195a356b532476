"""A float32 decode step of one sequence as one kernel call (common/f32_step.c).

float32 gives transformers' tokens to the last bit, so its one-call step is not fused.py's (whose
kernels have their own bits) but the op-by-op path's torch ops repeated in C: MKL's products
split as float32.py splits them, the op-by-op path's attention kernel, torch's sums, softmax and
SiLU as torch vectorises them on this host. Op by op, a float32 step at batch 1 spent more than a
third of its time between its products (some 60 torch calls a layer, their caches cold after the
weights streamed through).

Whether C repeats torch exactly depends on torch's build and this CPU (its vector width, its exp),
so the step is not trusted until a whole step of the first request gave the op-by-op path's logits
to the bit (engine/model.py compares them); a step that differs is logged and the model decodes op
by op from then on. It takes what fused.py takes, in plain float32 weights, for one sequence (the
products of more rows would need their own bits checked): Mixtral's and Qwen3's families.
"""

from __future__ import annotations

import ctypes

import torch

from common import bf16, float32
from common.arch import ModelSpec
from common.moe import plain_silu
from common.weights import DenseWeights, FFNWeights
from router_service.engine.fused import OneCallStep, plain, unfit_model
from router_service.engine.layers import AttentionBatch, Rope
from router_service.engine.sampling import greedy

_L, _I, _F, _P = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIZES = "layers hidden heads kv_heads head_dim experts top_k inter vocab num_blocks block_size"
_POINTERS = "qkv o router post_norm next_norm q_norm k_norm cache_k cache_v gate_up down up"
# The products' bits in f32_step.c's `split`
_QKV, _O, _ROUTER, _GATE_UP, _DOWN, _HEAD, _HALVES = 1, 2, 4, 8, 16, 32, 64


class _Model(ctypes.Structure):  # f32_step.c's moe_model_f32, field for field
    _fields_ = [
        *((n, _L) for n in _SIZES.split()),
        *((n, _I) for n in ("renorm", "qk_norm", "lanes", "split")),
        ("eps", _F),
        ("scale", _F),
        *((n, _P) for n in ("sgemm", "set_threads", "expf8", "embed", "first_norm", "lm_head")),
        *((n, _P) for n in _POINTERS.split()),
    ]


def unfit(spec: ModelSpec, w: DenseWeights) -> str | None:
    """Why a float32 decode step of this model cannot be one call (None: it can)."""
    if w.embed.dtype != torch.float32 or w.embed.device.type != "cpu":
        return "not float32 on the CPU"
    if bf16.kernel("moe_decode_step_f32") is None or float32.mkl() is None:
        return "the kernel does not run here, or torch's BLAS is not MKL"
    if float32.sleef_exp() is None or float32.torch_lanes() is None:
        return "torch's exp or vector width unknown here"
    if (why := unfit_model(spec, w)) is not None:
        return why
    read = [w.embed, w.final_norm, w.lm_head]
    for layer in w.layers:
        a = layer.attention
        read += [layer.input_norm, layer.post_attention_norm, layer.router, a.qkv, a.o]
        read += [a.q_norm, a.k_norm] if spec.qk_norm == "per_head" else []
    if not all(plain(t, torch.float32) for t in read):
        return "weights not plain float32"
    return None


class FusedDecodeF32(OneCallStep):
    """fused.FusedDecode's surface for a float32 model, one sequence a step; `trusted` once a
    step of it gave the op-by-op path's logits (engine/model.py checks the first)."""

    max_tokens = 1
    CACHE_DTYPE = torch.float32
    EXPERT_FIELDS = ("gate_up", "down", "up")

    def __init__(self, spec: ModelSpec, w: DenseWeights, threads: int) -> None:
        self.spec, self.weights, self.threads = spec, w, threads
        self.trusted = False
        layers = w.layers
        m = self.model = _Model()
        m.layers, m.hidden = len(layers), spec.hidden_size
        m.heads, m.kv_heads = spec.num_heads, spec.num_kv_heads
        m.head_dim, m.experts, m.top_k = spec.head_dim, spec.num_experts, spec.top_k
        m.vocab = w.lm_head.shape[0]
        m.renorm, m.lanes = spec.norm_topk_prob, float32.torch_lanes()
        m.qk_norm = spec.qk_norm == "per_head"
        m.eps, m.scale = spec.rms_norm_eps, spec.head_dim**-0.5
        m.sgemm, m.set_threads = float32.mkl()
        m.expf8 = float32.sleef_exp()
        m.embed, m.lm_head = w.embed.data_ptr(), w.lm_head.data_ptr()
        m.first_norm = layers[0].input_norm.data_ptr()
        arrays = {
            "qkv": [x.attention.qkv for x in layers],
            "o": [x.attention.o for x in layers],
            "router": [x.router for x in layers],
            "post_norm": [x.post_attention_norm for x in layers],
            "next_norm": [x.input_norm for x in layers[1:]] + [w.final_norm],
        }
        if m.qk_norm:
            arrays["q_norm"] = [x.attention.q_norm for x in layers]
            arrays["k_norm"] = [x.attention.k_norm for x in layers]
        self._held: dict[str, ctypes.Array] = {}
        for name, tensors in arrays.items():
            self._point(name, tensors)
        first = layers[0]
        self._split = _split_bits(
            threads,
            (_QKV, first.attention.qkv),
            (_O, first.attention.o),
            (_ROUTER, first.router),
            (_HEAD, w.lm_head),
        )
        self.chosen = torch.empty(m.layers, 1, spec.top_k, dtype=torch.int64)
        self.x, self.h = (torch.empty(1, spec.hidden_size) for _ in range(2))
        self.logits = torch.empty(1, m.vocab)

    def runs_on(self, threads: int) -> bool:
        """Only on the threads it was built for: its products' split bits were checked for
        them, and the op-by-op path splits a product another way on another count."""
        return threads == self.threads

    def _point_at(self, ffns: list[FFNWeights]) -> bool:
        m, first = self.model, ffns[0]
        inter, apart = first.down.shape[-1], first.up is not None  # gate and up as stored
        for f in ffns:
            gate_up = (f.gate_up, f.up) if apart else (f.gate_up,)
            if (f.up is not None) != apart or not plain_silu(f):
                return False
            if not all(plain(t, torch.float32) for t in (*gate_up, f.down)):
                return False
            rows = inter if apart else 2 * inter
            if any(t.shape != (rows, m.hidden) for t in gate_up) or f.down.shape != (
                m.hidden,
                inter,
            ):
                return False
        m.inter = inter
        self._point("gate_up", [f.gate_up for f in ffns])
        self._point("down", [f.down for f in ffns])
        if apart:
            self._point("up", [f.up for f in ffns])
        m.split = self._split | _split_bits(
            self.threads, (_HALVES if apart else _GATE_UP, first.gate_up), (_DOWN, first.down)
        )
        return True

    def step(
        self, tokens: list[int], batch: AttentionBatch, rope: Rope, threads: int | None = None
    ) -> torch.Tensor:
        """Float32 logits [1, vocab] of the step's one decode token, on the threads the step
        was built for (runs_on), whatever `threads` says."""
        [token], [position] = tokens, batch.positions.tolist()
        [length], [slot] = batch.decode_lengths.tolist(), batch.slots.tolist()
        table = bf16.dense(batch.decode_tables)
        return self._run(token, position, table, length, slot, rope).clone()

    def at(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> torch.Tensor:
        """`step` of one sequence's `token` at `position`, its block table `table` [1, width]
        int64 (dense), its context `length` tokens, its keys and values written to `slot`."""
        return self._run(token, position, table, length, slot, rope).clone()

    def greedy_at(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> int:
        """The token sampling.greedy picks from `at`'s logits."""
        return greedy(self._run(token, position, table, length, slot, rope)[0])

    def _run(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> torch.Tensor:
        """The step's logits, in a buffer the next step reuses."""
        hd = self.spec.head_dim
        # Read in place, unchecked by the kernel: what indexing them in torch would refuse.
        if not (0 <= token < self.weights.embed.shape[0] and 0 <= position < rope.cos.shape[0]):
            raise IndexError(f"token {token} or position {position} out of range")
        cos = rope.cos.data_ptr() + position * hd * 4
        sin = rope.sin.data_ptr() + position * hd * 4
        failed = bf16.kernel("moe_decode_step_f32")(
            ctypes.byref(self.model),
            token,
            cos,
            sin,
            table.data_ptr(),
            table.shape[1],
            length,
            slot,
            self.x.data_ptr(),
            self.h.data_ptr(),
            self.logits.data_ptr(),
            self.chosen.data_ptr(),
            self.threads,
        )
        if failed:
            raise MemoryError("decode step: no memory for its intermediates")
        return self.logits


def _split_bits(threads: int, *products: tuple[int, torch.Tensor]) -> int:
    """The `split` bits of these products at one row: those float32.linear splits."""
    return sum(bit for bit, w in products if float32.splits(w, 1, threads))
