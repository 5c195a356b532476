"""One copy of the weights: what a load keeps as views of the file (shared by every process
mapping it), what it copies, and that the file pages behind each copy leave the process."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import float32
from common import linear as L
from common.checkpoint import Checkpoint
from common.float32_rows import Rows
from common.moe import expert_ffn
from common.safetensors_mmap import SafetensorsFile
from common.weights import FFNWeights
from tests.support.factories import realigned

MIB = 2**20


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> SafetensorsFile:
    save_file(tensors, path)
    return SafetensorsFile(path)


def _mapping_rss_kib(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and first == "Rss:":
            total += int(line.split()[1])
    return total


@pytest.fixture
def released(monkeypatch) -> list[torch.Tensor]:
    """Every view a load asks its files to release."""
    views: list[torch.Tensor] = []
    original = SafetensorsFile.release

    def spy(self, view):
        done = original(self, view)
        if done:
            views.append(view)
        return done

    monkeypatch.setattr(SafetensorsFile, "release", spy)
    return views


def test_tensors_stored_back_to_back_join_into_one_view(tmp_path) -> None:
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    f = _save(tmp_path / "a.safetensors", {"a.gate": gate, "a.up": up, "b": torch.randn(3, 8)})
    joined = f.joined(["a.gate", "a.up"])
    assert joined is not None and joined.shape == (8, 8)
    assert torch.equal(joined, torch.cat([gate, up]))
    assert joined.data_ptr() == f.get("a.gate").data_ptr()  # a view: no copy
    assert f.contains(joined) and not f.contains(torch.cat([gate, up]))


@pytest.mark.parametrize(
    "tensors",
    [
        {"a": torch.randn(4, 8), "b": torch.randn(4, 8), "c": torch.randn(4, 8)},  # b between
        {"a": torch.randn(4, 8), "c": torch.randn(4, 8, dtype=torch.float64)},  # dtypes differ
        {"a": torch.randn(4, 8), "c": torch.randn(4, 6)},  # row lengths differ
    ],
)
def test_tensors_apart_do_not_join(tmp_path, tensors) -> None:
    f = _save(tmp_path / "a.safetensors", tensors)
    assert f.joined(["a", "c"]) is None


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_release_drops_the_pages_and_a_later_read_sees_the_file(tmp_path) -> None:
    big = torch.randn(4 * MIB // 4)  # 4 MiB of float32
    path = tmp_path / "big.safetensors"
    f = _save(path, {"big": big, "small": torch.ones(3)})
    view = f.get("big")
    assert float(view.sum()) == pytest.approx(float(big.sum()))  # every page read
    assert _mapping_rss_kib(path) >= 4 * 1024 - 8
    assert f.release(view)
    assert _mapping_rss_kib(path) < 64  # only the partial pages at its ends may stay
    assert torch.equal(view, big)  # read back from the file, unchanged


def test_release_leaves_what_is_not_a_view_of_the_file(tmp_path) -> None:
    f = _save(tmp_path / "a.safetensors", {"a": torch.randn(4, 8)})
    assert not f.release(torch.randn(4, 8))  # before mapping, and after:
    assert not f.release(f.get("a").t().contiguous())


def _bfloat16_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(dst / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_gate_and_up_stored_apart_stay_two_views_of_the_file(checkpoint, tmp_path) -> None:
    """Mixtral stores w1 (gate), w2 (down), w3 (up): joining gate and up would copy them."""
    path = _bfloat16_copy(checkpoint("mixtral"), tmp_path / "bf16")
    ckpt = Checkpoint(path)
    w = ckpt.load_experts([(0, 1)])[(0, 1)]
    [file] = ckpt._files.values()
    assert w.up is not None
    assert all(file.contains(t) for t in (w.gate_up, w.up, w.down))
    p = "model.layers.0.block_sparse_moe.experts.1."
    assert torch.equal(w.gate_up, file.get(p + "w1.weight"))
    assert torch.equal(w.up, file.get(p + "w3.weight"))
    assert w.nbytes == 3 * w.down.numel() * 2
    x = torch.randn(5, w.down.shape[0], dtype=torch.bfloat16)
    fused = FFNWeights(gate_up=torch.cat([w.gate_up, w.up]), down=w.down)
    assert torch.equal(expert_ffn(x, w), expert_ffn(x, fused))


def test_float32_gate_and_up_stored_apart_stay_views_with_the_joined_products_bits(
    checkpoint, released, tmp_path
) -> None:
    """transformers computes Mixtral's w1 (gate) and w3 (up) as one float32 product over [gate;
    up] joined into a new tensor: two views give its bits where they lie as a new tensor would."""
    path = realigned(checkpoint("mixtral"), tmp_path / "aligned")
    ckpt = Checkpoint(path)
    w = ckpt.load_experts([(1, 2)])[(1, 2)]
    [file] = ckpt._files.values()
    if not float32.halves_agree(w.gate_up, w.up):
        pytest.skip("products over halves differ in bits from the joined one on this host")
    assert w.up is not None and all(file.contains(t) for t in (w.gate_up, w.up, w.down))
    p = "model.layers.1.block_sparse_moe.experts.2."
    joined = torch.cat([file.get(p + "w1.weight"), file.get(p + "w3.weight")])
    for rows in (1, 5, 40):
        x = torch.randn(rows, w.down.shape[0])
        assert torch.equal(expert_ffn(x, w), expert_ffn(x, FFNWeights(gate_up=joined, down=w.down)))
    assert not released


@pytest.mark.parametrize("why", ["8 bytes past a multiple of 64", "halves' bits differ"])
def test_float32_gate_and_up_lying_elsewhere_or_differing_are_one_copy_and_their_pages_released(
    checkpoint, released, tmp_path, monkeypatch, why
) -> None:
    """A one-row product's bits depend on where its weight lies: views elsewhere than a new
    tensor would lie, or whose products' bits differ from the joined one's, are joined into a new
    tensor, as transformers joins them."""
    if why.startswith("halves"):
        monkeypatch.setattr(float32, "_halves_agree", lambda out, k: False)
    at = 8 if why.startswith("8") else 0
    ckpt = Checkpoint(realigned(checkpoint("mixtral"), tmp_path / "copy", at=at))
    w = ckpt.load_experts([(1, 2)])[(1, 2)]
    [file] = ckpt._files.values()
    assert w.up is None and not file.contains(w.gate_up) and file.contains(w.down)
    p = "model.layers.1.block_sparse_moe.experts.2."
    assert torch.equal(w.gate_up, torch.cat([file.get(p + "w1.weight"), file.get(p + "w3.weight")]))
    assert [v.data_ptr() for v in released] == [
        file.get(p + n).data_ptr() for n in ("w1.weight", "w3.weight")
    ]


def test_gate_and_up_stored_back_to_back_are_one_view(checkpoint, released) -> None:
    """Qwen stores down_proj, gate_proj, up_proj: gate and up are already one [2I, H] matrix."""
    ckpt = Checkpoint(checkpoint("qwen3_moe"))
    w = ckpt.load_experts([(0, 3)])[(0, 3)]
    [file] = ckpt._files.values()
    p = "model.layers.0.mlp.experts.3."
    assert w.up is None and file.contains(w.gate_up) and file.contains(w.down)
    assert w.gate_up.data_ptr() == file.get(p + "gate_proj.weight").data_ptr()
    assert torch.equal(w.gate_up[w.gate_up.shape[0] // 2 :], file.get(p + "up_proj.weight"))
    assert not released


def test_converted_weights_release_their_pages(checkpoint, released) -> None:
    ckpt = Checkpoint(checkpoint("qwen3_moe"), dtype=torch.bfloat16)
    w = ckpt.load_experts([(0, 3)])[(0, 3)]
    assert w.gate_up.dtype == torch.bfloat16 and w.up is None
    inter, hidden = ckpt.spec.expert_intermediate_size, ckpt.spec.hidden_size
    assert sorted(v.numel() for v in released) == [inter * hidden] * 3  # down, gate, up


def test_a_fused_expert_converts_its_own_rows_only(checkpoint, released) -> None:
    """A [E, 2I, H] tensor: the one expert's rows are sliced before conversion, not all E."""
    ckpt = Checkpoint(checkpoint("mixtral", expert_layout="fused"), dtype=torch.bfloat16)
    w = ckpt.load_experts([(0, 5)])[(0, 5)]
    inter, hidden = ckpt.spec.expert_intermediate_size, ckpt.spec.hidden_size
    assert sorted(v.numel() for v in released) == [inter * hidden, 2 * inter * hidden]
    reference = Checkpoint(checkpoint("mixtral")).load_experts([(0, 5)])[(0, 5)]
    assert torch.equal(w.gate_up, reference.gate_up.to(torch.bfloat16))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's layout needs mkldnn")
def test_prepacked_weights_release_the_pages_they_were_packed_from(
    checkpoint, released, monkeypatch
) -> None:
    monkeypatch.setenv("MOE_MESH_PREPACK", "on")  # oneDNN's layout, not float32 as stored
    L.packed.cache_clear()  # it reads MOE_MESH_PREPACK once a process
    try:
        ckpt = Checkpoint(checkpoint("qwen3_moe"), prepack=True, batch_invariant=True)
        w = ckpt.load_experts([(1, 0)])[(1, 0)]
    finally:
        L.packed.cache_clear()  # ... and the next test may read it without
    if not w.down.is_mkldnn:
        pytest.skip("oneDNN has no float32 layout here")
    assert len(released) == 2  # down, and gate and up's one view


def test_float32_weights_used_as_stored_release_nothing(checkpoint, released, monkeypatch) -> None:
    monkeypatch.delenv("MOE_MESH_PREPACK", raising=False)
    ckpt = Checkpoint(checkpoint("mixtral"), prepack=True, batch_invariant=True)
    w = ckpt.load_experts([(1, 0)])[(1, 0)]
    if not isinstance(w.down, Rows):
        pytest.skip("no C compiler or no AVX2+FMA: no float32 kernel here")
    assert released == [] and isinstance(w.up, Rows)  # Mixtral's w1 and w3: two views


def test_copies_go_block_by_block_releasing_each_block(checkpoint, released, monkeypatch) -> None:
    """A copy never holds a whole matrix of read pages beside it: blocks of COPY_BLOCK_BYTES."""
    monkeypatch.setattr("common.checkpoint.COPY_BLOCK_BYTES", 1000)
    ckpt = Checkpoint(checkpoint("mixtral"))
    p = "model.layers.2.block_sparse_moe.experts.0."
    inter, hidden = ckpt.spec.expert_intermediate_size, ckpt.spec.hidden_size
    parts = [ckpt.tensor(p + n, (inter, hidden)) for n in ("w1.weight", "w3.weight")]
    expected = torch.cat(parts)  # before: a released block reads back from the file anyway
    for dtype in (None, torch.bfloat16):
        released.clear()
        out = ckpt.copied(parts, dtype)
        assert torch.equal(out, expected.to(dtype or torch.float32))
        per_part = -(-inter * hidden // 250)  # 250 float32 per block
        assert len(released) == 2 * per_part
        assert sum(v.numel() for v in released) == 2 * inter * hidden
