"""A GPU's passes (engine/gpu.py, device_pass.py, graphs.py), run on the CPU where no GPU is:
grouped-product MoE layers give the dispatcher path's tokens and routing counts; decode steps
replay from graphs captured once per bucket, over a pass that makes no host synchronisation and
no tensor off the model's device, and whose replays read no tensor the engine let go; padded rows
change no real row. The same pass on a real GPU is bench/gpu_check.py's, and the CUDA test at
the end."""

from __future__ import annotations

import asyncio
import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from common import bf16
from common import linear as L
from router_service import build
from router_service.engine import gpu, graphs
from router_service.engine.model import MoeModel, pack_step
from router_service.experts.backends import ColocatedExperts
from router_service.settings import RouterSettings

BLOCK = 4
PROMPTS = [[5, 9, 11, 3, 7, 2], [8, 1, 4], [2, 2, 6, 10, 12]]


class NoHostSync(TorchFunctionMode):
    """Refuses what makes a host wait for a GPU: a tensor's values read into Python."""

    SYNCS = frozenset(
        {
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.__bool__,
            torch.Tensor.__int__,
            torch.Tensor.__float__,
            torch.Tensor.__index__,
            torch.Tensor.nonzero,
            torch.nonzero,
            torch.Tensor.unique,
            torch.unique,
            torch.bincount,
            torch.Tensor.bincount,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            raise AssertionError(f"a captured pass read a tensor on the host: {func}")
        return func(*args, **(kwargs or {}))


class Reads(TorchFunctionMode):
    """The tensors a captured pass reads that it did not make. A CUDA graph keeps the memory of
    what it made (its pool) but only the addresses of these: their owners must keep them alive
    for as long as the graph replays, or a replay reads whatever took their place."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.outside: dict[int, list[weakref.ref]] = {}
        self.what: dict[int, str] = {}  # the first tensor read at each address, described

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors((args, kwargs)):
            if (where := _address(t)) is not None and where not in self.made:
                self.outside.setdefault(where, []).append(weakref.ref(t))
                self.what.setdefault(where, f"{t.dtype} {list(t.shape)} read by {func.__name__}")
        for t in _tensors(out):
            if (where := _address(t)) is not None:
                self.made.add(where)
        return out

    def dropped(self, run) -> list[str]:
        """Those nothing holds any more but `run`'s closure, which a real graph does not keep (an
        object the closure holds, holding one, is not looked into)."""
        cells = run.__closure__ or ()
        return [
            self.what[where]
            for where, refs in self.outside.items()
            if not any(_holders(r) > sum(c.cell_contents is r() for c in cells) for r in refs)
        ]


def _holders(ref: weakref.ref) -> int:
    """The references to what `ref` points at (0 once it is gone), this reading not counted."""
    return 0 if ref() is None else sys.getrefcount(ref()) - _READING


_PROBE = torch.empty(0)  # held by this name alone: what reading it as _holders does adds
_READING = sys.getrefcount(weakref.ref(_PROBE)()) - 1


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _address(t: torch.Tensor) -> int | None:
    if t.device.type == "meta" or not t.numel():
        return None
    return t.untyped_storage().data_ptr()


class CpuGraphs:
    """A GraphBackend on the CPU with a CUDA graph's contract: capture runs the pass once over
    the static inputs (here with no host read and no tensor made on the default device, which
    is the meta device meanwhile), each replay leaves the pass's new outputs in the captured
    output tensors, and a replay refuses to run once a tensor the capture read but did not
    make has been let go (a real graph would read freed memory)."""

    def __init__(self) -> None:
        self.captures: list[tuple[int, ...]] = []

    def capture(self, run):
        torch.set_default_device("meta")
        try:
            with NoHostSync(), Reads() as reads:
                outputs = run()
        finally:
            torch.set_default_device(None)
        self.captures.append(tuple(outputs[1].shape))
        return (run, outputs, reads), outputs

    def replay(self, graph) -> None:
        run, outputs, reads = graph
        assert not (gone := reads.dropped(run)), f"a graph reads tensors nobody holds: {gone}"
        for kept, new in zip(outputs, run()):
            kept.copy_(new)


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """Weights as a GPU holds them, plain tensors, and no CPU kernel: torch's ops alone."""
    monkeypatch.setenv("MOE_MESH_PREPACK", "off")
    monkeypatch.setattr(bf16, "library", lambda: None)
    L.panels.cache_clear()
    L.packed.cache_clear()
    yield
    L.panels.cache_clear()
    L.packed.cache_clear()


def off_the_default_device(run):
    """`run`, making every tensor it makes without a device on the meta device: one made so
    meets the model's tensors in some op, which then fails (on a GPU it would be on the CPU)."""

    def wrapped(*args):
        torch.set_default_device("meta")
        try:
            return run(*args)
        finally:
            torch.set_default_device(None)

    return wrapped


def model(path, dtype: str, backend=None, device_pass: bool = True) -> MoeModel:
    s = RouterSettings(  # on the CPU where a GPU is too: the stand-ins are these tests' point
        checkpoint=path, dtype=dtype, max_model_len=64, max_num_seqs=4, device="cpu"
    )
    m = build.build_model(build._open(s), s)
    m.fused = None  # the CPU's one-call step would take a lone sequence's decode
    if device_pass:
        m.gpu = gpu.GpuPasses(
            m.spec, m.weights, m.dispatcher, m._layers, 4, m.max_model_len, backend
        )
    return m


def generate(
    m: MoeModel, steps: int, prompts=PROMPTS, close: bool = True
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of each prompt, all decoding together, and the routed counts."""

    async def run() -> list[list[int]]:
        cache = m.new_cache(64, BLOCK)
        tables = [list(range(s * 16, s * 16 + 16)) for s in range(len(prompts))]
        logits = await m.forward(
            pack_step([(t, 0, p) for t, p in zip(tables, prompts)], [], BLOCK), cache
        )
        out = [[t] for t in logits.argmax(dim=-1).tolist()]
        for step in range(steps):
            decodes = [(t, o[-1], len(p) + step + 1) for t, p, o in zip(tables, prompts, out)]
            logits = await m.forward(pack_step([], decodes, BLOCK), cache)
            for o, t in zip(out, logits.argmax(dim=-1).tolist()):
                o.append(t)
        return out

    try:
        return asyncio.run(run()), m.dispatcher.routed_counts()
    finally:
        if close:
            m.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx"])
def test_grouped_products_give_the_dispatcher_paths_tokens(checkpoint, arch):
    path = checkpoint(arch)
    want, want_counts = generate(model(path, "float32", device_pass=False), 6)
    m = model(path, "float32")
    m.gpu._eager = off_the_default_device(m.gpu._eager)  # prefills too
    got, counts = generate(m, 6)
    assert m.gpu.stacks is not None  # every layer took the grouped products
    assert got == want
    assert counts == want_counts


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_decode_steps_replay_captured_graphs(checkpoint, arch):
    path = checkpoint(arch)
    want, want_counts = generate(model(path, "bfloat16"), 8)  # the same pass, eager
    graphs = CpuGraphs()
    m = model(path, "bfloat16", graphs)
    got, counts = generate(m, 8)
    # three sequences in a bucket of 4: the padded row changed no real row's tokens, nor the
    # routed counts (its choices are cut off before they are counted)
    assert got == want and counts == want_counts
    # their tables (at most 4 blocks) in width 4: one capture, replayed for every decode step
    s = m.spec
    assert graphs.captures == [(len(s.moe_layer_ids), 4, s.top_k)]  # chosen: [layers, bucket, k]
    assert list(m.gpu.graphs.graphs) == [(4, 4)] and m.gpu.graphs.replays == 8


def test_each_capture_gathers_into_a_workspace_of_its_own(checkpoint):
    """A workspace grown by an eager step or a warm-up and then replaced would leave a graph
    writing to freed memory: every captured run starts with none, so it allocates its own."""
    graphs, seen = CpuGraphs(), []
    capture = graphs.capture

    def watched(run):
        seen.append("capture")
        return capture(run)

    graphs.capture = watched
    m = model(checkpoint("mixtral"), "bfloat16", graphs)
    eager = m.gpu._eager

    def recording(tokens, attention, rows, cache):
        if seen and seen[-1] == "capture":
            seen[-1] = (cache._work.numel(), cache._tables)
        return eager(tokens, attention, rows, cache)

    m.gpu._eager = recording
    generate(m, 2)
    assert seen == [(0, None)]


def test_a_new_placement_drops_the_graphs_of_the_old_stacks(checkpoint):
    path = checkpoint("mixtral")
    graphs = CpuGraphs()
    m = model(path, "bfloat16", graphs)
    first, _ = generate(m, 2, close=False)
    old = m.gpu.graphs
    experts = build._open(
        RouterSettings(checkpoint=path, dtype="bfloat16", device="cpu")
    ).load_experts(m.dispatcher.placement)
    moved = ColocatedExperts(experts)  # as a re-tiering hands over a new backend
    m.dispatcher.set_placement({p: [moved] for p in experts})
    again, _ = generate(m, 2)
    assert again == first
    assert m.gpu.graphs is not old and len(graphs.captures) == 2


def test_a_new_placement_of_the_same_experts_keeps_their_stacks(checkpoint):
    m = model(checkpoint("mixtral"), "bfloat16", CpuGraphs())
    generate(m, 1, close=False)
    stacks = m.gpu.stacks
    kept = ColocatedExperts(dict(m.dispatcher.all_colocated()))  # the same views, a new table
    m.dispatcher.set_placement({p: [kept] for p in kept.weights})
    generate(m, 1)
    assert m.gpu.stacks is not stacks  # bound anew (and its graphs captured anew) ...
    assert all(m.gpu.stacks[i] is stacks[i] for i in stacks)  # ... over the same memory


def test_two_micro_batches_logits_outlive_the_next_replay(checkpoint):
    """The engine samples after every micro-batch's pass: a replay's logits must not be the
    graph's output buffer, which the next replay overwrites."""
    m = model(checkpoint("mixtral"), "bfloat16", CpuGraphs())

    async def run():
        cache = m.new_cache(64, BLOCK)
        tables = [list(range(s * 16, s * 16 + 16)) for s in range(2)]
        await m.forward(
            pack_step([(t, 0, PROMPTS[i]) for i, t in enumerate(tables)], [], BLOCK), cache
        )
        one = [(tables[0], 7, len(PROMPTS[0]) + 1)]
        other = [(tables[1], 9, len(PROMPTS[1]) + 1)]
        a = await m.forward(pack_step([], one, BLOCK), cache)
        kept = a.clone()
        await m.forward(pack_step([], other, BLOCK), cache)  # the same bucket, replayed
        return a, kept

    try:
        a, kept = asyncio.run(run())
    finally:
        m.close()
    assert m.gpu.graphs.replays == 2 and torch.equal(a, kept)


def test_a_capture_that_fails_leaves_every_step_eager(checkpoint):
    class Refusing(CpuGraphs):
        def capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    path = checkpoint("mixtral")
    m = model(path, "bfloat16", Refusing())
    got, _ = generate(m, 3)
    assert got == generate(model(path, "bfloat16"), 3)[0]
    assert "not permitted" in m.gpu.graphs.failed and m.gpu.graphs.replays == 0


def test_buckets_cover_sizes_and_widths_up_to_the_limits():
    g = graphs.DecodeGraphs(None, CpuGraphs(), 48, 100, 16, 0, torch.device("cpu"))
    assert g.sizes == [1, 2, 4, 8, 16, 24, 32, 48]
    assert g.widths == [4, 16, 64, 100]
    assert g.bucket(3, 1) == (4, 4)
    assert g.bucket(17, 17) == (24, 64)
    assert g.bucket(48, 100) == (48, 100)
    assert g.bucket(49, 1) is None and g.bucket(1, 101) is None


def test_a_pass_with_remote_experts_takes_the_dispatchers_path(checkpoint):
    path = checkpoint("mixtral")
    m = model(path, "float32", CpuGraphs())
    m.dispatcher.all_colocated = lambda: None  # as when some expert is only remote
    layers = m._layers

    async def dispatched(*args):  # the dispatcher's path makes no tensor off the device either
        return off_the_default_device(lambda: gpu.run_sync(layers(*args)))()

    m._layers = dispatched
    tokens, _ = generate(m, 2)
    assert m.gpu.stacks is None and m.gpu.graphs is None
    assert tokens == generate(model(path, "float32", device_pass=False), 2)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: none here")
def test_cuda_graphs_give_the_eager_passes_tokens(checkpoint, monkeypatch):
    path = checkpoint("mixtral")
    s = RouterSettings(checkpoint=path, dtype="bfloat16", max_model_len=64, device="cuda")
    graphed = build.build_model(build._open(s), s)
    monkeypatch.setenv("MOE_MESH_CUDA_GRAPHS", "off")
    eager = build.build_model(build._open(s), s)
    assert generate(graphed, 6)[0] == generate(eager, 6)[0]
    assert graphed.gpu.graphs.replays == 6 and eager.gpu.graphs is None
