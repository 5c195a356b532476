"""moe-mesh's bfloat16 kernel: F.linear's products to within one rounding, rows independent of
their batch-mates, any input width, and a clean refusal where it cannot be built. The tests of
the vector kernels run once per instruction set this CPU has (`isa`: AVX2+FMA, and AVX-512
where present), and the two must give the same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common import attention_kernels, bf16, linear
from common.errors import InvalidArgumentError
from common.moe import Routing, group_by_expert
from tests.support.kernels import assert_avx2_bits, paged

pytestmark = pytest.mark.skipif(
    bf16.level() < 1, reason="no C compiler or no AVX2+FMA here: the kernels cannot run"
)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 accumulation of the bfloat16 operands, rounded to bfloat16 once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b).bfloat16()


@pytest.mark.parametrize(("out", "width"), [(64, 1), (64, 17), (192, 96), (128, 1024)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_float32_accumulations_rounded_once(out, width, rows, with_bias, isa) -> None:
    gen = torch.Generator().manual_seed(rows * out + width)
    w = torch.randn(out, width, generator=gen).bfloat16()
    x = torch.randn(rows, width, generator=gen).bfloat16()
    bias = torch.randn(out, generator=gen).bfloat16() if with_bias else None
    got, want = bf16.Panels(w)(x, bias), reference(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    # Sums in another order may round to the neighbouring bfloat16, never further.
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-3)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.9


def test_a_row_gets_the_same_bits_whatever_its_batch_mates(isa) -> None:
    gen = torch.Generator().manual_seed(0)
    w = bf16.Panels(torch.randn(256, 512, generator=gen).bfloat16())
    x = torch.randn(40, 512, generator=gen).bfloat16()
    batch = w(x)
    for i in (0, 5, 6, 39):
        assert torch.equal(w(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(w(x[6:14]), batch[6:14])


def test_views_pack_and_inputs_of_any_leading_shape_multiply() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(96, 128, generator=gen).bfloat16()
    w = base.t()  # [128, 96], not contiguous: packing copies it first
    x = torch.randn(2, 3, 96, generator=gen).bfloat16()
    got = bf16.Panels(w)(x)
    assert got.shape == (2, 3, 128)
    assert torch.equal(got.view(6, 128), bf16.Panels(w.contiguous())(x.view(6, 96)))
    assert bf16.Panels(w)(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 128)


def test_other_input_dtypes_and_shapes_it_cannot_hold_are_refused() -> None:
    w = torch.randn(64, 32).bfloat16()
    with pytest.raises(TypeError, match="bfloat16 input"):
        bf16.Panels(w)(torch.randn(2, 32))
    assert bf16.fits(w)
    assert not bf16.fits(torch.randn(96, 32).bfloat16())  # rows not a multiple of 64
    assert not bf16.fits(torch.randn(64, 32))  # float32 stays torch's
    assert bf16.silu_ffn(torch.randn(2, 32).bfloat16(), w, w.T) is None  # plain weights: torch's
    with pytest.raises(TypeError, match="bfloat16 input"):
        bf16.silu_ffn(torch.randn(2, 64), bf16.Panels(w), bf16.Panels(w))


def test_without_a_compiler_there_is_no_kernel(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path / "cache"))
    bf16.library.cache_clear()
    try:
        assert bf16.library() is None
        assert not bf16.fits(torch.randn(64, 32).bfloat16())
        assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left
    finally:
        bf16.library.cache_clear()


def test_a_build_goes_to_the_cache_once(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOE_MESH_CACHE_DIR", str(tmp_path))
    bf16.library.cache_clear()
    try:
        assert bf16.library() is not None
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        stamp = built[0].stat().st_mtime_ns
        bf16.library.cache_clear()
        assert bf16.library() is not None and built[0].stat().st_mtime_ns == stamp
    finally:
        bf16.library.cache_clear()


def test_outputs_round_to_nearest_even_as_torch_rounds(isa) -> None:
    """Each output is the exact float32 sum of two inputs (weights of one and zero), so only the
    final rounding to bfloat16 can differ from torch's; ties and overflow included."""
    k = 64
    w = torch.zeros(128, k)
    for n in range(128):
        w[n, n % k] = w[n, (n + 1) % k] = 1
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, k, generator=gen) * 2.0 ** torch.randint(-3, 4, (7, k), generator=gen)
    x[0, :2] = torch.tensor([1.0, 2.0**-8])  # 1 + 2^-8: a tie, kept even
    x[1, :2] = torch.tensor([3.3e38, 3.3e38])  # past bfloat16's largest: inf
    x = x.bfloat16()
    got = bf16.Panels(w.bfloat16())(x)
    a, b = x.float()[:, torch.arange(128) % k], x.float()[:, (torch.arange(128) + 1) % k]
    assert torch.equal(got, (a + b).bfloat16())
    assert got[1, 0] == float("inf")
    x[2, 5] = float("nan")
    assert torch.isnan(bf16.Panels(w.bfloat16())(x)[2]).all()  # 0 x NaN is NaN, as in torch


@pytest.mark.parametrize("shape", [(1, 1024), (7, 64), (3, 5, 128), (70, 256)])
def test_rms_norm_rounds_as_transformers_recipe_does(shape, isa) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=gen) * 4).bfloat16()
    w = torch.randn(shape[-1], generator=gen).bfloat16()
    # transformers: in float32, the normalised row rounded, then times the weight in bfloat16
    want = w * F.rms_norm(x.float(), x.shape[-1:], None, 1e-5).bfloat16()
    same, got = bf16.rms_norm(x, w, 1e-5)
    assert same is x and got.shape == x.shape and got.dtype == torch.bfloat16
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps == 0).float().mean() >= 0.99
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # the same values, not contiguous
    assert torch.equal(bf16.rms_norm(strided, w, 1e-5)[1], got)
    # With a residual delta: x + delta rounded as torch's add rounds, and the norm of that sum.
    delta = (torch.randn(*shape, generator=gen) * 4).bfloat16()
    total, normed = bf16.rms_norm(x - delta, w, 1e-5, delta)
    assert torch.equal(total.view(torch.int16), ((x - delta) + delta).view(torch.int16))
    assert torch.equal(normed, bf16.rms_norm(total, w, 1e-5)[1])


def test_rms_norm_leaves_what_it_cannot_take_to_torch() -> None:
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
    assert bf16.rms_norm(x.float(), w, 1e-5) is None  # float32 input
    assert bf16.rms_norm(x, w.float(), 1e-5) is None  # float32 weight
    assert bf16.rms_norm(x[:, :40], w[:40], 1e-5) is None  # width not a multiple of 16
    assert bf16.rms_norm(x, w, 1e-5, x[:1]) is None  # a delta of another shape


def routed(n: int, k: int, gen: torch.Generator) -> list:
    """The expert groups of n tokens, each routed to k distinct experts of 32 (a lone token's
    slots are ints, as group_by_expert gives them)."""
    experts = torch.rand(n, 32, generator=gen).argsort(dim=1)[:, :k]
    return group_by_expert(Routing(experts, torch.rand(n, k)), 32)


def torch_combine(outputs, groups, weights, n, k, dtype) -> torch.Tensor:
    """moe.combine's torch recipe for many tokens (a lone token's int slots as a tensor)."""
    slots = torch.cat([torch.as_tensor(g.slots).reshape(-1) for g in groups])
    weighted = torch.cat(outputs) * weights.reshape(-1)[slots, None]
    ordered = torch.empty_like(weighted)
    ordered[slots] = weighted
    return ordered.view(n, k, -1).sum(dim=1).to(dtype)


@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_combine_gives_the_bits_of_torchs_multiply_and_sum(n, k, dtype, weight_dtype, isa) -> None:
    gen = torch.Generator().manual_seed(n * 100 + k)
    groups = routed(n, k, gen)
    outputs = [
        (torch.randn(g.size, 128, generator=gen) * 10.0 ** (i % 5 - 2)).to(dtype)
        for i, g in enumerate(groups)
    ]
    outputs[0][:, :4] = 0.0
    outputs[-1][:, 2:6] = -0.0  # a sum of zeros that starts from +0 is +0, as in torch
    weights = torch.rand(n, k, generator=gen).to(weight_dtype)
    want = torch_combine(outputs, groups, weights, n, k, dtype)
    got = bf16.combine(outputs, [g.slots for g in groups], weights.reshape(-1), k, dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (128, 8)])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("weights_bf16", [False, True])
def test_route_chooses_and_weighs_as_torchs_softmax_top_k(experts, k, renorm, weights_bf16, isa):
    gen = torch.Generator().manual_seed(experts + k)
    x = torch.randn(5, 256, generator=gen).bfloat16()
    w = torch.randn(experts, 256, generator=gen).bfloat16()
    chosen, weights = bf16.route(x, w, k, renorm, weights_bf16)
    probs = torch.softmax(reference(x, w, None).float(), dim=-1)
    top_w, top_e = torch.topk(probs, k, dim=-1)
    if renorm:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    # The logits are sums in another order than torch's: one may round to the neighbouring
    # bfloat16, which moves a weight by under 1% and can reorder near-equal experts only.
    same = (chosen.sort(dim=1).values == top_e.sort(dim=1).values).all(dim=1)
    assert same.sum() >= 4
    by_expert = [
        t.gather(1, e.argsort(dim=1))[same] for t, e in ((weights.float(), chosen), (top_w, top_e))
    ]
    assert torch.allclose(*by_expert, rtol=0.02, atol=1e-6)
    assert weights.dtype == (torch.bfloat16 if weights_bf16 else torch.float32)
    assert chosen.dtype == torch.int64 and chosen.shape == weights.shape == (5, k)


def test_route_breaks_ties_toward_the_lower_expert(isa) -> None:
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[1] = -x[0]
    w = torch.zeros(16, 64).bfloat16()  # every logit 0: all sixteen equal
    w[9] = x[0]  # but expert 9's: x[0] · x[0] > 0 for token 0, its negative for token 1
    chosen, _ = bf16.route(x, w, 4, True, False)
    assert chosen.tolist() == [[9, 0, 1, 2], [0, 1, 2, 3]]


def test_route_leaves_what_it_cannot_take_to_torch() -> None:
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert bf16.route(x.float(), w, 2, True, False) is None
    assert bf16.route(x, w.float(), 2, True, False) is None
    assert bf16.route(x, w, 9, True, False) is None  # more choices than experts
    assert (
        bf16.route(torch.randn(2, 40).bfloat16(), torch.randn(8, 40).bfloat16(), 2, True, False)
        is None
    )


@pytest.mark.parametrize("n, k, num_experts", [(0, 2, 8), (1, 2, 8), (37, 2, 8), (64, 8, 256)])
def test_group_sorts_choices_by_expert_as_a_stable_argsort(n, k, num_experts) -> None:
    experts = torch.randint(0, num_experts, (n, k), generator=torch.Generator().manual_seed(n))
    order, tokens, counts = bf16.group(experts, num_experts)
    want = torch.argsort(experts.reshape(-1), stable=True)
    assert torch.equal(order, want) and torch.equal(tokens, want // k)
    assert counts == torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    if n:
        experts[n // 2, 0] = num_experts  # out of range: left to torch, which raises
        assert bf16.group(experts, num_experts) is None


def test_combine_leaves_what_it_cannot_take_to_torch() -> None:
    groups = routed(4, 2, torch.Generator().manual_seed(0))
    outputs = [torch.randn(g.size, 64) for g in groups]
    slots = [g.slots for g in groups]
    w = torch.rand(8)
    assert bf16.combine(outputs, slots, w, 2, torch.float32) is not None  # what it takes
    assert bf16.combine(outputs, slots, w, 2, torch.bfloat16) is None  # a cast it does not do
    assert bf16.combine([o.double() for o in outputs], slots, w, 2, torch.float64) is None
    assert bf16.combine([o[:, :40] for o in outputs], slots, w, 2, torch.float32) is None
    assert bf16.combine(outputs, slots, w.double(), 2, torch.float32) is None
    assert bf16.combine(outputs, slots, w[:6], 2, torch.float32) is None  # a weight per choice
    # The kernel checks the slots: each choice exactly once.
    twice = [slots[0], *slots[1:-1], slots[0][: len(slots[-1])]]
    assert (
        bf16.combine(outputs[:-1] + [outputs[0][: len(slots[-1])]], twice, w, 2, torch.float32)
        is None
    )
    outside = [*slots[:-1], slots[-1] + 100]
    assert bf16.combine(outputs, outside, w, 2, torch.float32) is None


def ffn_pair(hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
    return gate_up.bfloat16(), (torch.randn(hidden, inter, generator=gen) / inter**0.5).bfloat16()


def op_by_op(x: torch.Tensor, gate_up: bf16.Panels, down: bf16.Panels) -> torch.Tensor:
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)


@pytest.mark.parametrize(
    ("rows", "hidden", "inter"), [(1, 1024, 1024), (7, 256, 512), (40, 128, 64)]
)
def test_silu_ffn_rounds_where_the_op_by_op_recipe_rounds(rows, hidden, inter, isa) -> None:
    gate_up, down = (bf16.Panels(w) for w in ffn_pair(hidden, inter, rows))
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(9)) * 2).bfloat16()
    x[0, :4] = torch.tensor([60.0, -60.0, 1e-3, -1e-3])  # gates far into silu's tails
    got, want = bf16.silu_ffn(x, gate_up, down), op_by_op(x, gate_up, down)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps == 0).float().mean() >= 0.99
    assert torch.equal(bf16.silu_ffn(x[:1], gate_up, down), got[:1])  # rows stay independent
    assert bf16.silu_ffn(x.view(1, rows, hidden), gate_up, down).shape == (1, rows, hidden)
    assert bf16.silu_ffn(x[:0], gate_up, down).shape == (0, hidden)


@pytest.mark.parametrize(("hidden", "inter"), [(128, 64), (256, 96)])
def test_a_layers_experts_in_one_call_are_one_call_each_to_the_bit(hidden, inter, isa) -> None:
    sizes = [1, 0, 7, 3, 13]  # an expert with no rows too
    weights = [[bf16.Panels(w) for w in ffn_pair(hidden, inter, seed)] for seed in range(5)]
    gen = torch.Generator().manual_seed(3)
    xs = [(torch.randn(n, hidden, generator=gen) * 2).bfloat16() for n in sizes]
    got = bf16.silu_ffns([(x, gu, d) for x, (gu, d) in zip(xs, weights)])
    assert [y.shape for y in got] == [(n, hidden) for n in sizes]
    for y, x, (gate_up, down) in zip(got, xs, weights):
        assert torch.equal(y, bf16.silu_ffn(x, gate_up, down))


def test_experts_in_one_call_need_panels_of_one_shape() -> None:
    a, b = (bf16.Panels(w) for w in ffn_pair(128, 64, 0))
    c, d = (bf16.Panels(w) for w in ffn_pair(128, 96, 1))
    x = torch.randn(2, 128).bfloat16()
    assert bf16.silu_ffns([]) is None
    assert bf16.silu_ffns([(x, a, b), (x, c, d)]) is None  # another intermediate size
    assert bf16.silu_ffns([(x, a, b), (x, a, b.data)]) is None  # a weight not in panels
    with pytest.raises(TypeError, match="bfloat16 input"):
        bf16.silu_ffns([(x.float(), a, b)])


def test_silu_of_extreme_gates_is_torchs(isa) -> None:
    # gate = x[i], up = x[63] = 1, down = identity: the output is silu(x) itself.
    n = 64
    gate = torch.eye(n)
    gate[-1] = 0
    up = torch.zeros(n, n)
    up[:, -1] = 1
    gate_up, down = (
        bf16.Panels(torch.cat([gate, up]).bfloat16()),
        bf16.Panels(torch.eye(n).bfloat16()),
    )
    x = torch.zeros(1, n)
    values = [0.0, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 120.0, -120.0, 1e-30, -3.0e38]
    x[0, : len(values)] = torch.tensor(values)
    x[0, -1] = 1
    x = x.bfloat16()
    got = bf16.silu_ffn(x, gate_up, down)[0, : len(values)]
    assert torch.equal(got, F.silu(x[0, : len(values)]))


def test_the_level_is_what_the_cpu_flags_say() -> None:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    flags = next((set(li.split(":", 1)[1].split()) for li in lines if li.startswith("flags")), None)
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags here")
    avx512 = {"avx512f", "avx512bw"} <= flags
    tiles = avx512 and {"amx_tile", "amx_bf16"} <= flags  # Linux grants them where it lists them
    assert bf16.level() == (3 if tiles else 2 if avx512 else int({"avx2", "fma"} <= flags))


def test_max_isa_holds_every_kernel_to_the_instruction_set_it_names(monkeypatch) -> None:
    full, before = bf16.library().moe_bf16_supported(), bf16.level()
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(3, 32).bfloat16()
    want = bf16.Panels(w)(x, None)
    try:
        for name, cap in (("avx512", 2), ("avx2", 1), ("none", 0)):
            monkeypatch.setenv("MOE_MESH_MAX_ISA", name)
            bf16.library.cache_clear()
            assert bf16.level() == min(full, cap)
            assert bf16._format(tiles=True) == 0  # no AMX tiles below `all`
            if cap:  # the vector kernels give the same bits at every level
                assert torch.equal(
                    bf16.Panels(w)(x, None).view(torch.int16), want.view(torch.int16)
                )
                assert bf16.kernel("moe_int8_dot")(128) == 0  # int8 on the float kernels
            else:  # torch computes instead
                assert not bf16.fits(w) and bf16.rms_norm(x, w[0], 1e-5) is None
        monkeypatch.setenv("MOE_MESH_MAX_ISA", "sse")
        bf16.library.cache_clear()
        with pytest.raises(InvalidArgumentError, match="MOE_MESH_MAX_ISA: 'sse' is not one of "):
            bf16.library()
    finally:
        monkeypatch.undo()  # the run's own MOE_MESH_MAX_ISA, if it has one
        bf16.library.cache_clear()
    assert bf16.level() == before  # the library's state is one per process


def test_a_cpu_without_the_vector_kernels_runs_only_the_plain_ones(monkeypatch) -> None:
    x, w, slots = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16(), [torch.tensor([0, 1])]
    caches = paged(torch.float32, 2, 32)
    attention = (torch.randn(1, 2, 32), *caches, torch.zeros(1, 1, dtype=torch.int64))
    attention += (torch.tensor([1]), 0.2)
    runs = (
        lambda: bf16.rms_norm(x, w, 1e-5),
        lambda: bf16.combine([x], slots, torch.ones(2), 1, torch.bfloat16),
        lambda: attention_kernels.decode_attention(*attention),
    )
    assert all(run() is not None for run in runs) and bf16.fits(torch.randn(64, 32).bfloat16())
    monkeypatch.setattr(bf16.library(), "level", 0)  # neither AVX2+FMA nor AVX-512
    assert all(run() is None for run in runs) and not bf16.fits(torch.randn(64, 32).bfloat16())
    assert bf16.group(torch.tensor([[1, 0]]), 2) is not None  # plain C: any x86-64
    assert attention_kernels.rope(torch.randn(1, 2, 8), *torch.randn(2, 1, 1, 8)) is not None
    assert attention_kernels.kv_write(*torch.randn(2, 1, 2, 32), torch.tensor([3]), *caches)


def outputs_of_every_vector_kernel() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=gen).bfloat16()
    gate_up, down = (bf16.Panels(w) for w in ffn_pair(256, 128, 3))
    norm = bf16.rms_norm(x, torch.randn(256, generator=gen).bfloat16(), 1e-5, x.flip(0))
    groups = routed(9, 4, gen)
    rows = [torch.randn(g.size, 256, generator=gen).bfloat16() for g in groups]
    k_cache, v_cache = paged(torch.bfloat16, 2, 64)
    tables = torch.stack([torch.randperm(64, generator=gen)[:38] for _ in range(3)])
    q = torch.randn(3, 6, 64, generator=gen).bfloat16()
    return [
        gate_up(x, torch.randn(256, generator=gen)),
        bf16.silu_ffn(x, gate_up, down),
        *norm,
        bf16.combine(
            rows, [g.slots for g in groups], torch.rand(36, generator=gen), 4, torch.bfloat16
        ),
        attention_kernels.decode_attention(
            q, k_cache, v_cache, tables, torch.tensor([1, 37, 150]), 0.125
        ),
    ]


def test_avx2_and_avx512_give_the_same_bits() -> None:
    assert_avx2_bits(outputs_of_every_vector_kernel)


def test_dense_panels_take_amx_tiles_from_8_rows_and_otherwise_the_vector_kernels() -> None:
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(192, 256, generator=gen).bfloat16(), torch.randn(192, generator=gen)
    vector, tiles = bf16.Panels(w), bf16.Panels(w, tiles=True)
    assert vector.format == 0 and tiles.format == (bf16.TILES if bf16.level() >= 3 else 0)
    for rows in (1, 7, 8, 9, 16, 17, 40, 100):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        got = tiles(x, bias)
        if rows < 8 or bf16.level() < 3:  # the vector kernel's own bits
            assert torch.equal(got, vector(x, bias))
        want = F.linear(x.double(), w.double(), bias.double())
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=8e-3)
        assert torch.equal(tiles(x[:1], bias), vector(x[:1], bias))
    lib = bf16.library()
    try:
        lib.moe_bf16_limit(2)  # no tiles: the vector kernel's bits at every size
        x = torch.randn(40, 256, generator=gen).bfloat16()
        assert torch.equal(tiles(x, bias), vector(x, bias))
    finally:
        lib.moe_bf16_limit(3)


def test_batch_invariant_weights_never_take_tiles() -> None:
    w = torch.randn(128, 64).bfloat16()
    if not linear.in_panels(torch.bfloat16, tuple(w.shape)):
        pytest.skip("bfloat16 weights are not panels here")
    assert linear.prepack(w, batch_invariant=True, tiles=True).format == 0
    assert linear.prepack(w, tiles=True).format == (bf16.TILES if bf16.level() >= 3 else 0)
