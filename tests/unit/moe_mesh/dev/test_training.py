"""moe_mesh.dev.training: `checkpoint create --train-steps N` learns, holds text out, stays loadable."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from common.checkpoint import Checkpoint
from moe_mesh.dev.bpe import tokenizer_json
from moe_mesh.dev.create_checkpoint import ARCHS, add_subcommand, create_checkpoint
from moe_mesh.dev.training import (
    HELDOUT_FILE,
    LOG_FILE,
    TrainSettings,
    balance_loss,
    batch_loss,
    default_text,
    lr_at,
    split_corpus,
)
from tests.support.hf import load

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 61]])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models train several times faster on one thread than on two cores other work shares;
    one thread count also makes the same seed give the same weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(512))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~12k tokens: tokenizing it takes a tenth of the time the default text takes."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("".join(f"Sentence number {i} says something.\n" for i in range(600)))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_checkpoint(
        tmp_path_factory.mktemp("trained") / "mixtral", "mixtral", train_steps=60, seed=3
    )


def test_training_lowers_the_loss_on_seen_and_held_out_text(trained: Path) -> None:
    log = json.loads((trained / LOG_FILE).read_text())
    loss = log["loss"]
    assert len(loss) == 60
    # Measured: 6.24 -> 5.06 (means of the first and last five steps), held out 6.26 -> 5.18
    # (uniform: ln 512 = 6.24); the docs, the default text, change: hence the margin.
    assert sum(loss[-5:]) / 5 < 0.9 * sum(loss[:5]) / 5
    held = log["heldout_loss"]
    assert held["after"] < 0.9 * held["before"]
    assert log["seed"] == 3 and log["settings"]["steps"] == 60
    assert log["settings"]["balance_coef"] > 0 and log["settings"]["router_z_coef"] > 0


def test_heldout_text_is_the_tail_of_the_text_not_trained_on(
    trained: Path, tokenizer: Tokenizer
) -> None:
    text, _ = default_text()
    heldout = (trained / HELDOUT_FILE).read_text(encoding="utf-8")
    log = json.loads((trained / LOG_FILE).read_text())
    assert text.endswith(heldout) and text[: -len(heldout)].endswith("\n")
    assert len(tokenizer.encode(heldout).ids) == log["heldout_tokens"] >= 600
    whole = len(tokenizer.encode(text).ids)
    assert log["heldout_tokens"] >= 0.1 * whole
    assert log["train_tokens"] + log["heldout_tokens"] == pytest.approx(whole, abs=2)


def test_trained_checkpoint_loads_in_transformers_and_checkpoint(trained: Path) -> None:
    model = load(trained)
    ckpt = Checkpoint(trained)
    ffn = ckpt.load_experts([(1, 5)])[(1, 5)]
    gate_up = ffn.gate_up if ffn.up is None else torch.cat([ffn.gate_up, ffn.up])
    hf = model.model.layers[1].mlp.experts  # [experts, 2 * inter, hidden], [experts, hidden, inter]
    assert torch.equal(gate_up, hf.gate_up_proj[5]) and torch.equal(ffn.down, hf.down_proj[5])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=PROMPT).logits).all()
    # Training moved the weights away from what the same seed draws.
    random = load(create_checkpoint(trained.parent / "random", "mixtral", seed=3))
    assert not torch.equal(random.lm_head.weight, model.lm_head.weight)


def test_same_seed_same_weights(tmp_path: Path, text_file: Path) -> None:
    a, b, c = (
        create_checkpoint(
            tmp_path / n, "qwen2_moe", seed=s, train_steps=4, train_text=text_file, router_skew=2.0
        )
        for n, s in (("a", 1), ("b", 1), ("c", 2))
    )
    for name in ("model.safetensors", HELDOUT_FILE, LOG_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # Skewed routers keep their hot experts: no load-balancing loss to train the skew away.
    settings = json.loads((a / LOG_FILE).read_text())["settings"]
    assert settings["balance_coef"] == settings["router_z_coef"] == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_trains_then_saves(tmp_path: Path, arch: str, text_file: Path) -> None:
    quantize = "mxfp4" if arch == "gpt_oss" else None  # quantized after training
    path = create_checkpoint(
        tmp_path / arch,
        arch,
        train_steps=3,
        train_text=text_file,
        quantize=quantize,
        dtype="bfloat16",
    )
    loss = json.loads((path / LOG_FILE).read_text())["loss"]
    assert len(loss) == 3 and all(x == x for x in loss)  # not NaN
    assert (path / HELDOUT_FILE).exists()
    if quantize is None:  # transformers dequantizes MXFP4 only when asked (test_create_checkpoint)
        with torch.no_grad():
            assert torch.isfinite(load(path)(input_ids=PROMPT).logits).all()
    Checkpoint(path).load_experts([(2, 0)])


def test_split_corpus(tokenizer: Tokenizer) -> None:
    lines = [f"line {i} of a text with some words in it, {i * 7}." for i in range(400)]
    text = "\n".join(lines) + "\n"
    settings = TrainSettings(steps=1)
    corpus = split_corpus(text, "lines", tokenizer, settings)
    want = -(-len(tokenizer.encode(text).ids) // 10)  # 10%, rounded up: above 600 here
    assert corpus.heldout_text.startswith("line ") and text.endswith(corpus.heldout_text)
    assert want > 600 and want <= len(corpus.heldout_ids) < want + 30  # at most a line more
    assert tokenizer.decode(corpus.train_ids) + corpus.heldout_text == text

    with pytest.raises(ValueError, match="has 487 tokens; at least 729 are needed"):
        split_corpus(text[:800], "short", tokenizer, settings)  # 600 held out + 129 to train
    one_line = text.replace("\n", " ")
    with pytest.raises(ValueError, match="too few lines"):
        split_corpus(one_line, "one line", tokenizer, settings)


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v3"])  # softmax and sigmoid routers
def test_balance_loss_only_when_training(arch: str) -> None:
    from moe_mesh.dev.create_checkpoint import _config, _random_model
    from moe_mesh.dev.families import PRESET_SIZES

    model = _random_model(arch, _config(arch, PRESET_SIZES["tiny"], 512, None, None), 0, 0.0)
    batch = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ce, balance = batch_loss(model.train(), batch, 0.05)
        assert float(balance) > 0 and torch.isfinite(ce)
        assert batch_loss(model.train(), batch, 0.0)[1] == 0.0  # off
        z_only = batch_loss(model.train(), batch, 0.0, 1e-3)[1]
        assert 0 < float(z_only) < float(balance)  # 1e-3 x logsumexp^2 of small random logits
        assert batch_loss(model.eval(), batch, 0.05)[1] == 0.0  # not when evaluating
        assert torch.equal(batch_loss(model, batch)[0], ce)  # the same cross-entropy either way


def test_balance_loss_is_top_k_when_balanced_and_more_per_collapsed_layer() -> None:
    even = torch.zeros(64, 8)  # [tokens, experts]: every expert as likely
    even[torch.arange(64), torch.arange(64) % 8] = 1.0  # ... and each the top one for 8 tokens
    collapsed = torch.zeros(64, 8)
    collapsed[:, :2] = 5.0  # every token to experts 0 and 1
    assert balance_loss([even], 1) == pytest.approx(1.0, rel=0.01)
    assert balance_loss([collapsed], 2) > 3.5  # ~4: all of the slots on 2 of 8 experts
    # Per layer: two layers collapsed onto different experts are not balanced together.
    other = collapsed.roll(4, dims=1)
    assert balance_loss([collapsed, other], 2) == pytest.approx(balance_loss([collapsed], 2))


def test_learning_rate_warms_up_then_decays() -> None:
    s = TrainSettings(steps=100, lr=1e-3)
    rates = [lr_at(i, s) for i in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(1e-4, rel=0.01)
    assert lr_at(0, TrainSettings(steps=1)) == pytest.approx(1e-3)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="moe-mesh")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_trains_on_a_text_file(
    tmp_path: Path, text_file: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out, text = tmp_path / "cli", text_file
    argv = ["--arch", "olmoe", "--out", str(out), "--train-steps", "10", "--train-text", str(text)]
    assert run_cli("checkpoint", "create", *argv) == 0
    stdout, stderr = capfd.readouterr()
    assert stdout.strip() == str(out)
    steps = [line for line in stderr.splitlines() if "[checkpoint] step " in line]
    assert len(steps) == 10 and "step 10/10: loss " in steps[-1] and "tokens/s" in steps[-1]
    assert "held-out loss" in stderr
    assert text.read_text().endswith((out / HELDOUT_FILE).read_text())
    assert json.loads((out / LOG_FILE).read_text())["text"] == str(text)


def test_cli_errors(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    base = ["checkpoint", "create", "--arch", "olmoe", "--out", str(tmp_path / "x")]
    assert run_cli(*base, "--train-steps", "5", "--train-text", str(tmp_path / "none.txt")) == 2
    assert "cannot read training text" in capfd.readouterr().err
    assert run_cli(*base, "--train-text", str(tmp_path / "none.txt")) == 2
    assert "train_steps must be > 0 to train on train_text" in capfd.readouterr().err
    (tmp_path / "short.txt").write_text("too short\n")
    assert run_cli(*base, "--train-steps", "5", "--train-text", str(tmp_path / "short.txt")) == 2
    assert "at least" in capfd.readouterr().err
    assert not (tmp_path / "x").exists()
