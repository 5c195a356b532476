"""bench/vs_llamacpp.py: without llama-cpp-python the bench says it is skipped, why and how to
install it, exits 0 and writes that, creating nothing; the bytes and agreement it reports are the
arithmetic they name. With llama-cpp-python: llama.cpp's logits on the converted checkpoint
(Mixtral, Qwen3-MoE) are transformers' (float32), sequence by sequence within one batch, and a run
writes a row per batch and expert type."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import FLAGS, vs_llamacpp, write_result
from bench.geometry import GEOMETRIES, bytes_per_token, geometry_spec


def test_without_llama_cpp_the_bench_is_skipped_and_says_why(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(vs_llamacpp, "load_peer", lambda: (None, "llama_cpp is not installed"))
    out, ckpt = tmp_path / "r.json", tmp_path / "never-created"
    assert vs_llamacpp.main(["--out", str(out), "--checkpoint", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    assert "vs_llamacpp skipped: llama_cpp is not installed" in printed
    assert "pip install -e '.[peers]'" in printed
    result = json.loads(out.read_text())
    assert result["skipped"] is True
    assert result["reason"] == "llama_cpp is not installed"
    assert "'.[peers]'" in result["install"]
    assert set(result["host_cpu"]["flags"]) >= {"avx2", "avx512_bf16", "amx_bf16"}
    assert not ckpt.exists()  # no checkpoint made, nothing converted


def test_a_missing_package_is_named(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    lib, why = vs_llamacpp.load_peer()
    assert lib is None
    assert "llama_cpp" in why or "gguf" in why


def test_an_unknown_expert_type_is_refused_before_anything_runs(tmp_path) -> None:
    with pytest.raises(SystemExit, match="q5_k"):
        vs_llamacpp.main(["--out", str(tmp_path / "r.json"), "--experts", "bf16,q5_k"])
    assert not (tmp_path / "r.json").exists()


def test_llama_cpps_bytes_per_token_count_quantized_experts_at_their_block_size() -> None:
    spec = geometry_spec(GEOMETRIES["small"])
    for batch in (1, 8, 32):
        bf16 = bytes_per_token(spec, 2, batch)
        assert vs_llamacpp.peer_bytes_per_token(spec, "bf16", batch) == bf16
    # small at batch 1: 8 layers x 2 experts x 3 x 1024 x 1024 expert weights a token reads
    experts = 8 * 2 * 3 * 1024 * 1024
    q8 = vs_llamacpp.peer_bytes_per_token(spec, "q8_0", 1)
    q4 = vs_llamacpp.peer_bytes_per_token(spec, "q4_0", 1)
    assert q8 == bytes_per_token(spec, 2, 1) - round(experts * (2 - 34 / 32))
    assert q4 == bytes_per_token(spec, 2, 1) - round(experts * (2 - 18 / 32))


def test_agreement_counts_tokens_before_each_sequences_first_difference() -> None:
    assert vs_llamacpp.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) == 1.0
    assert vs_llamacpp.agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [7, 5, 6]]) == 1 / 6


@pytest.fixture(scope="module")
def llama_cpp():
    lib, why = vs_llamacpp.load_peer()
    if lib is None:
        pytest.skip(f"needs llama-cpp-python ({why}): {vs_llamacpp.INSTALL}")
    return lib


@pytest.mark.parametrize(
    ("arch", "overrides"), [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True})]
)
def test_llama_cpps_logits_are_transformers_float32_ones(
    llama_cpp, checkpoint, tmp_path, arch, overrides
) -> None:
    from bench.gguf_export import convert
    from tests.support.hf import load

    ckpt = checkpoint(arch, **({"overrides": overrides} if overrides else {}))
    convert(ckpt, tmp_path / "f32.gguf", "f32", "f32")
    peer = vs_llamacpp.LlamaCpp(llama_cpp, tmp_path / "f32.gguf", threads=1)
    prompts = [[5, 17, 99, 250, 3, 400, 8, 77], [300, 2, 41, 41, 19, 511, 64, 128]]
    try:
        peer.open(2, 8, 16)
        rows = [(s, j, t, True) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        theirs = peer.step(rows).copy().reshape(2, 8, -1)  # [sequence, position, vocab]
    finally:
        peer.close()
    with torch.inference_mode():
        ours = load(ckpt)(torch.tensor(prompts)).logits.numpy()
    # llama.cpp keeps its KV cache in float16: differences of that order (4e-4 and 7e-4 of the
    # largest logit here), not of a wrong map: Mixtral's q and k rows left in transformers' order
    # move them by 6e-2, the second sequence run on the first one's cache by 0.9.
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() < 3e-3 * scale
    top2 = np.sort(ours, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2e-2 * scale  # not a near-tie
    assert clear.sum() > 8
    assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all()


def test_a_run_writes_a_row_per_batch_and_expert_type(llama_cpp, checkpoint, tmp_path, capsys):
    ckpt, out = checkpoint("mixtral"), tmp_path / "r.json"
    argv = ["--checkpoint", str(ckpt), "--out", str(out), "--batch-sizes", "1,3"]
    argv += ["--experts", "bf16,q8_0", "--new-tokens", "4", "--prompt-len", "5", "--repeats", "1"]
    assert vs_llamacpp.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch"], r["llama_cpp_experts"]): r for r in result["results"]}
    assert set(rows) == {(1, "bf16"), (1, "q8_0"), (3, "bf16"), (3, "q8_0")}
    for r in rows.values():
        assert r["engine_tokens_per_s"] > 0 and r["llama_cpp_tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["engine_tokens_per_s"] / r["llama_cpp_tokens_per_s"])
        assert 0 <= r["greedy_agreement"] <= 1
    assert result["threads"] == torch.get_num_threads()
    assert result["llama_cpp"]["version"] == llama_cpp.__version__
    assert result["llama_cpp"]["system_info"]  # the instructions its build uses
    assert all(row["engine_serial_max_tokens"] >= 0 for row in rows.values())
    assert rows[(3, "q8_0")]["engine_experts"] == "int8"  # our int8 experts against q8_0
    assert rows[(3, "q8_0")]["engine_bytes_per_token"] < rows[(3, "bf16")]["engine_bytes_per_token"]
    assert "batch   3: engine (int8)" in capsys.readouterr().out


def test_sequences_of_a_batch_decode_as_they_do_alone(llama_cpp, checkpoint, tmp_path) -> None:
    from bench.gguf_export import convert

    convert(checkpoint("mixtral"), tmp_path / "f32.gguf", "f32", "f32")
    peer = vs_llamacpp.LlamaCpp(llama_cpp, tmp_path / "f32.gguf", threads=1)
    prompts = [[5, 17, 99, 250, 3], [300, 2, 41, 41, 19, 511, 64, 128, 7]]  # uneven lengths
    try:
        peer.open(2, 9, 16)
        _, together = peer.generate(prompts, 6)
        peer.open(1, 9, 16)
        alone = [peer.generate([p], 6)[1][0] for p in prompts]
    finally:
        peer.close()
    assert together == alone
    assert all(len(t) == 6 for t in together)


def test_every_benchs_result_names_the_hosts_cpu_model_and_flags(tmp_path) -> None:
    # bench.write_result adds what vs_llamacpp's JSON had alone: every figure is quoted with them
    write_result(tmp_path / "r.json", {"figure": 1.0})
    result = json.loads((tmp_path / "r.json").read_text())
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(line for line in cpuinfo if line.startswith("model name"))
    assert result["figure"] == 1.0 and result["host_cpu"]["cpu"] == model.split(":", 1)[1].strip()
    flags = set(next(line for line in cpuinfo if line.startswith("flags")).split())
    assert result["host_cpu"]["flags"] == {f: f in flags for f in FLAGS}
