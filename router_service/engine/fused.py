"""A decode step of the running sequences as one kernel call (common/decode_kernel.c).

At small batches a step reads every weight it uses about once; op by op it is also a few hundred
torch and ctypes calls, each waking the thread team, about a third of a step at batch 1 on 2
cores. Where the model and its placement allow, a step of decode tokens only (one a sequence,
up to MAX_TOKENS sequences) is one call on one thread team: embedding, every layer's attention,
routing, each routed expert over its tokens, combine, the LM head, with the op-by-op path's bits.

It takes: weights in moe-mesh's panels (bfloat16, or int8 and int4 from --quantize and
--quantize-dense; FP8 experts run op by op), RMSNorm, RoPE over whole heads, q/k norms none or
per head, the plain softmax router, no shared experts, dense layers, sliding windows, sinks or
biases, and every routed expert colocated in one backend (engine/model.py checks the placement
each pass). Anything else runs op by op. `MOE_MESH_FUSED_DECODE=off` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch

from common import bf16
from common.arch import ModelSpec
from common.linear import linear
from common.moe import fusable
from common.weights import DenseWeights, FFNWeights
from router_service.engine.kv_cache import KVCache
from router_service.engine.layers import AttentionBatch, Rope
from router_service.engine.sampling import greedy

_L, _I, _F, _P = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIZES = "layers hidden heads kv_heads head_dim experts top_k inter vocab num_blocks block_size"
_FLAGS = "format dense_format head_format renorm weights_bf16 qk_norm"
_POINTERS = "qkv o post_norm next_norm q_norm k_norm router cache_k cache_v gate_up gate_up_scales"


class _Model(ctypes.Structure):  # decode_kernel.c's moe_model, field for field
    _fields_ = [
        *((n, _L) for n in (*_SIZES.split(), "group", "dense_group", "head_group")),
        *((n, _I) for n in _FLAGS.split()),
        ("eps", _F),
        ("scale", _F),
        *((n, _P) for n in _POINTERS.split()),
        *((n, _P) for n in ("down", "down_scales", "first_norm", "lm_head")),
        *((n, _P) for n in ("qkv_scales", "o_scales", "head_scales")),
    ]


class _Token(ctypes.Structure):  # decode_kernel.c's moe_token
    _fields_ = [
        ("count", _L),
        *((n, _P) for n in ("embedding", "cos", "sin", "tables")),
        ("width", _L),
        *((n, _P) for n in ("lengths", "slots")),
    ]


class _Burst(ctypes.Structure):  # decode_kernel.c's moe_burst
    _fields_ = [
        *((n, _L) for n in ("token", "start", "steps")),
        ("embed", _P),
        ("embed_rows", _L),
        *((n, _P) for n in ("cos", "sin", "table")),
        *((n, _L) for n in ("width", "block_size")),
        ("ending", _P),
        ("endings", _L),
        ("halt", _P),
        ("deadline", ctypes.c_double),
    ]


# Sequences a step in one call takes at most: its serial phases (norms, routing, grouping,
# combine) grow with them while the op-by-op path splits them over the threads.
MAX_TOKENS = 64


def enabled() -> bool:
    """MOE_MESH_FUSED_DECODE: `on` (default) runs a decode step as one kernel call where the
    model allows; `off` always op by op."""
    return os.environ.get("MOE_MESH_FUSED_DECODE", "on").lower() not in ("off", "0", "false", "no")


def unfit(spec: ModelSpec, w: DenseWeights) -> str | None:
    """Why a decode step of this model cannot be one call (None: it can)."""
    if w.embed.device.type != "cpu" or bf16.kernel("moe_decode_step") is None:
        return "the kernels do not run here, or the weights are on a GPU"
    if (why := unfit_model(spec, w)) is not None:
        return why
    read = [w.embed, w.final_norm]  # what the kernel reads as bfloat16 rows, as they are
    for x in w.layers:
        read += [x.input_norm, x.post_attention_norm, x.router]
        read += [x.attention.q_norm, x.attention.k_norm] if spec.qk_norm == "per_head" else []
    if not all(plain(t, torch.bfloat16) for t in read):
        return "embeddings, norms or routers not plain bfloat16"
    first = w.layers[0].attention.qkv
    for layer in w.layers:
        a = layer.attention
        if any(not _panels(t) or _kind(t) != _kind(first) for t in (a.qkv, a.o)):
            return "attention weights not in panels of one format"
    return None


def unfit_model(spec: ModelSpec, w: DenseWeights) -> str | None:
    """What neither one-call step computes (this file's, fused_f32.py's): None where the
    model's layers are theirs, whatever its weights' format."""
    if spec.mla is not None or spec.norm != "rms" or spec.router != "softmax":
        return "latent attention, LayerNorm or another router"
    if spec.qk_norm not in ("none", "per_head") or spec.clip_qkv is not None:
        return "q/k normed over all heads or clipped"
    if spec.rope.interleaved or (spec.rope.rotary_dim or spec.head_dim) != spec.head_dim:
        return "RoPE over part of a head or interleaved"
    if any(spec.is_sliding(i) for i in range(spec.num_layers)) or spec.head_dim % 16:
        return "sliding windows, or heads not a multiple of 16"
    if not 0 < spec.top_k <= min(16, spec.num_experts) or spec.hidden_size % 16:
        return "more than 16 experts a token"  # combine sums up to 16 choices as torch does
    for layer in w.layers:
        a = layer.attention
        if layer.router is None or layer.shared_expert is not None or layer.dense_mlp is not None:
            return "a dense layer or shared experts"
        if layer.router_bias is not None or layer.router_correction is not None:
            return "a router bias"
        if any(t is not None for t in (a.qkv_bias, a.o_bias, a.sinks)):
            return "attention biases or sinks"
    return None


def plain(t: object, dtype: torch.dtype) -> bool:
    """A plain contiguous `dtype` tensor: what a one-call kernel reads as it is."""
    return (
        isinstance(t, torch.Tensor) and t.dtype == dtype and not t.is_mkldnn and t.is_contiguous()
    )


def _panels(weight: object) -> bool:
    """In panels (bfloat16, or common.quant's int8 or int4) that the step's products read."""
    return isinstance(weight, bf16.Panels) and weight.format in (0, 1, 2, bf16.TILES)


def _kind(weight: bf16.Panels) -> tuple[int, int]:
    return weight.format, weight.group


def _array(pointers: list[int]) -> ctypes.Array:
    return (_P * len(pointers))(*pointers)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Buffers:
    """A step's outputs and the pointer arrays its tokens point at, for `n` tokens."""

    def __init__(self, n: int, hidden: int, vocab: int, layers: int, top_k: int) -> None:
        self.n = n
        self.x, self.h = (torch.empty(n, hidden, dtype=torch.bfloat16) for _ in range(2))
        self.logits = torch.empty(n, vocab, dtype=torch.bfloat16)
        self.chosen = torch.empty(layers, n, top_k, dtype=torch.int64)
        self.embedding, self.cos, self.sin = ((_P * n)() for _ in range(3))


class OneCallStep:
    """What the one-call steps share (this file's, fused_f32.py's): the KV cache and every
    layer's every expert, bound when they change (a new cache, a new placement), and the experts
    the last step routed to. A subclass sets `model` (its ctypes structure, with num_blocks,
    block_size, cache_k and cache_v), `_held` (the pointer arrays it points into), `spec`,
    `chosen`, CACHE_DTYPE and EXPERT_FIELDS, and says in _point_at whether it takes the experts."""

    CACHE_DTYPE: torch.dtype
    EXPERT_FIELDS: tuple[str, ...]  # the model's fields pointing at expert weights
    model: ctypes.Structure
    spec: ModelSpec
    chosen: torch.Tensor  # [layers, sequences, top_k]: the last step's experts
    _held: dict[str, ctypes.Array]
    _cache: KVCache | None = None
    _experts: Mapping | None = None  # bound
    _refused: Mapping | None = None  # the current ones, which the kernel cannot take

    def bind_cache(self, cache: KVCache) -> bool:
        """Point the step at `cache`; False where the kernel cannot read it."""
        if cache is self._cache:
            return True
        k, v = cache.k, cache.v
        if {k.dtype, v.dtype} != {self.CACHE_DTYPE} or not (
            k.is_contiguous() and v.is_contiguous()
        ):
            return False
        if cache.v_dim != cache.head_dim or cache.head_dim != self.spec.head_dim:
            return False
        m = self.model
        m.num_blocks, m.block_size = cache.num_blocks, cache.block_size
        self._held["cache_k"] = _array([k[i].data_ptr() for i in range(m.layers)])
        self._held["cache_v"] = _array([v[i].data_ptr() for i in range(m.layers)])
        m.cache_k = ctypes.addressof(self._held["cache_k"])
        m.cache_v = ctypes.addressof(self._held["cache_v"])
        self._cache = cache
        return True

    def bind_experts(self, experts: Mapping[tuple[int, int], FFNWeights]) -> bool:
        """Point the step at these experts' weights (every layer's every expert); False where
        the kernel cannot take them all (then the step runs op by op)."""
        if experts is self._experts:
            return True
        if experts is self._refused:  # checked once per placement, not once per step
            return False
        self.unbind_experts()
        self._refused = experts
        keys = [
            (layer, e) for layer in range(self.model.layers) for e in range(self.spec.num_experts)
        ]
        ffns = [experts.get(key) for key in keys]
        if any(f is None for f in ffns) or not self._point_at(ffns):
            return False
        self._experts, self._refused = experts, None
        return True

    def _point_at(self, ffns: list[FFNWeights]) -> bool:
        """Point the model at `ffns` (layer by layer, expert by expert); False where it cannot."""
        raise NotImplementedError

    def _point(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Point the model's field `name` at an array of these tensors' data."""
        self._held[name] = _array([t.data_ptr() for t in tensors])
        setattr(self.model, name, ctypes.addressof(self._held[name]))

    def runs_on(self, threads: int) -> bool:
        """Whether a step on `threads` threads gives the op-by-op path's bits there."""
        return True

    def routed(self) -> list[list[int]]:
        """The last step's experts, per layer those of every token in routing order."""
        return self.chosen.view(self.model.layers, -1).tolist()

    def refuses(self, experts: Mapping[tuple[int, int], FFNWeights]) -> bool:
        """Whether bind_experts found that it cannot take these experts."""
        return experts is self._refused

    def unbind_experts(self) -> None:
        """Hold no expert's weights (they moved away): bind_experts again before a step."""
        if self._experts is None and self._refused is None:
            return
        self._experts = self._refused = None
        for name in self.EXPERT_FIELDS:
            self._held.pop(name, None)
            setattr(self.model, name, None)


class FusedDecode(OneCallStep):
    """One model's step in one call: its dense part bound once, the KV cache and the experts'
    weights bound when they change (a new cache, a new placement)."""

    CACHE_DTYPE = torch.bfloat16
    EXPERT_FIELDS = ("gate_up", "down", "gate_up_scales", "down_scales")

    max_tokens = MAX_TOKENS
    trusted = True  # its bits are the op-by-op path's by construction (tested)

    def __init__(self, spec: ModelSpec, w: DenseWeights) -> None:
        self.spec, self.weights = spec, w
        s, layers = spec, w.layers
        m = self.model = _Model()
        m.layers, m.hidden = len(layers), s.hidden_size
        m.heads, m.kv_heads = s.num_heads, s.num_kv_heads
        m.head_dim, m.experts, m.top_k = s.head_dim, s.num_experts, s.top_k
        m.vocab = w.lm_head.shape[0]
        m.renorm, m.weights_bf16 = s.norm_topk_prob, not s.combine_in_fp32
        m.qk_norm, m.eps, m.scale = s.qk_norm == "per_head", s.rms_norm_eps, s.head_dim**-0.5
        norms_after = [layer.input_norm for layer in layers[1:]] + [w.final_norm]
        attention = [layer.attention for layer in layers]
        m.dense_format, m.dense_group = _kind(attention[0].qkv)
        self._routers = [layer.router.contiguous() for layer in layers]  # held: pointed at
        arrays = {
            "qkv": [a.qkv.data for a in attention],
            "o": [a.o.data for a in attention],
            "post_norm": [layer.post_attention_norm for layer in layers],
            "next_norm": norms_after,
            "router": self._routers,
        }
        if attention[0].qkv.scales is not None:  # int8 or int4 (--quantize-dense)
            arrays["qkv_scales"] = [a.qkv.scales for a in attention]
            arrays["o_scales"] = [a.o.scales for a in attention]
        if m.qk_norm:
            arrays["q_norm"] = [a.q_norm for a in attention]
            arrays["k_norm"] = [a.k_norm for a in attention]
        # Pointer arrays the structure points into, held as long as it is.
        self._held = {name: _array([t.data_ptr() for t in ts]) for name, ts in arrays.items()}
        for name, array in self._held.items():
            setattr(m, name, ctypes.addressof(array))
        m.first_norm = layers[0].input_norm.data_ptr()
        head = w.lm_head
        self.fused_head = _panels(head)  # else an LM head torch computes, after the call
        if self.fused_head:
            m.lm_head, m.head_scales = head.data.data_ptr(), _ptr(head.scales)
            m.head_format, m.head_group = _kind(head)
        self.token = _Token()
        self.chosen = torch.empty(m.layers, 1, s.top_k, dtype=torch.int64)
        self._buffers: _Buffers | None = None
        self._one_token = (ctypes.c_int64 * 2)()  # `at`'s context length and cache slot

    def _point_at(self, ffns: list[FFNWeights]) -> bool:
        if any(not fusable(f) or not _panels(f.down) for f in ffns):
            return False
        m, first = self.model, ffns[0]
        inter = first.down.shape[1]
        for f in ffns:
            if (f.gate_up.format, f.gate_up.group) != (first.gate_up.format, first.gate_up.group):
                return False
            if (f.down.format, f.down.group) != (f.gate_up.format, f.gate_up.group):
                return False
            if f.gate_up.shape != (2 * inter, m.hidden) or f.down.shape != (m.hidden, inter):
                return False
        m.format, m.group, m.inter = first.gate_up.format, first.gate_up.group, inter
        quantized = first.gate_up.scales is not None
        for name in ("gate_up", "down"):
            self._point(name, [getattr(f, name).data for f in ffns])
            setattr(self.model, name + "_scales", None)
            if quantized:
                self._point(name + "_scales", [getattr(f, name).scales for f in ffns])
        return True

    def step(
        self, tokens: list[int], batch: AttentionBatch, rope: Rope, threads: int | None = None
    ) -> torch.Tensor:
        """Float32 logits [sequences, vocab] of the step's decode tokens, one a sequence, on
        `threads` (default torch's); the experts each layer routed them to are in `chosen`
        [layers, sequences, top_k] until the next step."""
        b, tables = batch, bf16.dense(batch.decode_tables)
        lengths, slots = b.decode_lengths.contiguous(), b.slots.contiguous()
        where = b.positions.tolist()
        return self._run(
            tokens, where, tables, lengths.data_ptr(), slots.data_ptr(), rope, threads
        ).float()

    def at(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> torch.Tensor:
        """`step` of one sequence's `token` at `position`, its block table `table` [1, width]
        int64 (dense), its context `length` tokens, its keys and values written to `slot`."""
        return self._at(token, position, table, length, slot, rope).float()

    def greedy_at(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> int:
        """The token sampling.greedy picks from `at`'s logits: a greedy burst's step where the
        LM head is not in the call (with it, greedy_steps runs the whole burst in C)."""
        return greedy(self.at(token, position, table, length, slot, rope)[0])

    def greedy_steps(
        self,
        token: int,
        start: int,
        steps: int,
        table: list[int],
        block_size: int,
        rope: Rope,
        ending: frozenset[int],
        halt: ctypes.c_int,
        deadline: float | None,
    ) -> tuple[list[int], list[list[int]]] | None:
        """Up to `steps` greedy_at steps of one sequence from `token` at position `start` in one
        call (moe_decode_burst), its block table `table` covering them: the tokens, and each
        layer's experts over the steps. After the first step it ends once `halt` is set or past
        `deadline` (time.monotonic()); after a token in `ending`. None where the LM head is not
        in the call. Its arrays are ctypes', not torch's: after the steps, a torch op ran cold
        (0.4 ms a burst on host C)."""
        if not self.fused_head:
            return None
        steps = min(steps, rope.cos.shape[0] - start)  # past RoPE's reach: the next step refuses
        embed = self.weights.embed
        if steps < 1 or not 0 <= token < embed.shape[0]:
            raise IndexError(f"token {token} or position {start} out of range")
        m, b, k = self.model, self._buffers_for(1), self.spec.top_k
        tokens, chosen = (ctypes.c_int64 * steps)(), (ctypes.c_int64 * (m.layers * steps * k))()
        blocks = (ctypes.c_int64 * len(table))(*table)
        ends = (ctypes.c_int64 * len(ending))(*ending)
        burst = _Burst(
            token=token,
            start=start,
            steps=steps,
            embed=embed.data_ptr(),
            embed_rows=embed.shape[0],
            cos=rope.cos.data_ptr(),
            sin=rope.sin.data_ptr(),
            table=ctypes.addressof(blocks),
            width=len(table),
            block_size=block_size,
            ending=ctypes.addressof(ends),
            endings=len(ending),
            halt=ctypes.addressof(halt),
            deadline=deadline or 0.0,
        )
        made = bf16.kernel("moe_decode_burst")(
            ctypes.byref(m),
            ctypes.byref(burst),
            b.x.data_ptr(),
            b.h.data_ptr(),
            b.logits.data_ptr(),
            ctypes.addressof(chosen),
            ctypes.addressof(tokens),
            torch.get_num_threads(),
        )
        if made < 0:
            raise MemoryError("decode step: no memory for its intermediates")
        layers = range(0, m.layers * steps * k, steps * k)
        return tokens[:made], [chosen[at : at + made * k] for at in layers]

    def _buffers_for(self, n: int) -> _Buffers:
        """The outputs of steps of `n` tokens: steps of as many reuse them (a burst's allocate
        nothing)."""
        t, b = self.token, self._buffers
        if b is None or b.n != n:
            m = self.model
            b = self._buffers = _Buffers(n, m.hidden, m.vocab, m.layers, self.spec.top_k)
            t.embedding, t.cos, t.sin = (ctypes.addressof(a) for a in (b.embedding, b.cos, b.sin))
        return b

    def _at(
        self, token: int, position: int, table: torch.Tensor, length: int, slot: int, rope: Rope
    ) -> torch.Tensor:
        held = self._one_token
        held[0], held[1] = length, slot
        at = ctypes.addressof(held)
        return self._run([token], [position], table, at, at + 8, rope)

    def _run(
        self,
        tokens: list[int],
        where: list[int],
        tables: torch.Tensor,
        lengths: int,
        slots: int,
        rope: Rope,
        threads: int | None = None,
    ) -> torch.Tensor:
        """The step's logits: bfloat16 in a buffer the next step of as many tokens reuses where
        the LM head is in the call, else float32 from torch's. `lengths` and `slots` address
        int64 arrays [tokens] (the contexts, the cache slots), held by the caller."""
        n, hd, hidden = len(tokens), self.spec.head_dim, self.model.hidden
        # Read in place, unchecked by the kernel: what indexing them in torch would refuse.
        vocab, reach = self.weights.embed.shape[0], rope.cos.shape[0]
        if not all(0 <= a < vocab for a in tokens) or not all(0 <= p < reach for p in where):
            raise IndexError(f"a token of {tokens} or a position of {where} out of range")
        t, b = self.token, self._buffers_for(n)
        embed, cos, sin = self.weights.embed.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr()
        for i, (a, p) in enumerate(zip(tokens, where)):
            b.embedding[i] = embed + a * hidden * 2
            b.cos[i], b.sin[i] = cos + p * hd * 2, sin + p * hd * 2
        t.count, t.width = n, tables.shape[1]
        t.tables, t.lengths, t.slots = tables.data_ptr(), lengths, slots
        self.chosen = b.chosen
        failed = bf16.kernel("moe_decode_step")(
            ctypes.byref(self.model),
            ctypes.byref(t),
            b.x.data_ptr(),
            b.h.data_ptr(),
            b.logits.data_ptr(),
            b.chosen.data_ptr(),
            threads or torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("decode step: no memory for its intermediates")
        return b.logits if self.fused_head else linear(b.h, self.weights.lm_head).float()
