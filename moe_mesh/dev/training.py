"""Brief next-token training of a created checkpoint's model (`checkpoint create --train-steps N`).

Random weights give near-uniform next-token distributions, on which accuracy figures (top-1 agreement,
KL of quantized experts against bfloat16: issue 41) say nothing. A few hundred steps on real text
make them peaked. The default text is the project's own docs (docs/**/*.md, ~130k tokens): bpe.py's
prose is ~900 tokens, less than the held-out part alone needs, and its invented words carry no
structure to learn. The text's last part is held out of training and written to the checkpoint as
`heldout.txt`, so that an evaluation can teacher-force on text the model did not see.

Training is float32 on the CPU, seeded (same seed and thread count: same weights), AdamW with linear
warm-up and cosine decay; weight decay only on matrices; a load-balancing loss and a z-loss on every
MoE layer's router (none with router skew, which they would train away).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
HELDOUT_FILE, LOG_FILE = "heldout.txt", "training.json"


@dataclass(frozen=True)
class TrainSettings:
    """How a checkpoint is trained. One window of 128 tokens a step keeps 200 steps of the `small`
    Mixtral within minutes on 2 cores (docs/design/checkpoints.md has the figures)."""

    steps: int
    batch: int = 1
    seq_len: int = 128
    lr: float = 1e-3  # peak, after warm-up
    warmup_fraction: float = 0.1
    min_lr_fraction: float = 0.1  # cosine decay ends at lr x this
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # x a per-layer load-balancing loss on the routers' logits: without it a few hundred steps send
    # most tokens to a few experts and none to others.
    balance_coef: float = 0.05
    # x ST-MoE's router z-loss (mean squared logsumexp of the logits): keeps the routers' softmax from
    # saturating, where the load-balancing loss has no gradient left (the small preset's last layers).
    router_z_coef: float = 1e-3
    heldout_fraction: float = 0.1
    min_heldout_tokens: int = 600
    eval_tokens: int = 1024  # held-out tokens the loss before and after training is measured on


def settings_for(steps: int, router_skew: float) -> TrainSettings:
    """The defaults, but without router losses for skewed routers: they would train the skew away."""
    if router_skew:
        return TrainSettings(steps, balance_coef=0.0, router_z_coef=0.0)
    return TrainSettings(steps)


@dataclass(frozen=True)
class Corpus:
    """A text tokenized and split: what the model trains on, and the tail held out of training."""

    train_ids: list[int]
    heldout_text: str
    heldout_ids: list[int]
    source: str  # where the text came from, for training.json
    sha256: str  # of the whole text, held-out part included


def default_text() -> tuple[str, str]:
    """(the project's docs, concatenated in path order; "docs/**/*.md"). ValueError without them."""
    paths = sorted(DOCS_DIR.rglob("*.md")) if DOCS_DIR.is_dir() else []
    if not paths:
        raise ValueError(f"no built-in training text: {DOCS_DIR} has no *.md; pass train_text")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in paths), "docs/**/*.md"


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, source) of `path`, or the default text; ValueError when it cannot be read."""
    if path is None:
        return default_text()
    try:
        return Path(path).read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read training text {path}: {exc}") from exc


def split_corpus(text: str, source: str, tokenizer: Any, settings: TrainSettings) -> Corpus:
    """Hold out the text's last lines: at least heldout_fraction of its tokens and min_heldout_tokens.

    The cut is at a line start, so that heldout.txt starts with whole words.
    Raises ValueError when too little is left to train on.
    """
    encoding = tokenizer.encode(text)
    want = max(
        math.ceil(len(encoding.ids) * settings.heldout_fraction), settings.min_heldout_tokens
    )
    need = want + settings.seq_len + 1
    if len(encoding.ids) < need:
        raise ValueError(
            f"training text {source} has {len(encoding.ids)} tokens; at least {need} are needed "
            f"({want} held out, a sequence of {settings.seq_len} + 1 to train on)"
        )
    start = encoding.offsets[len(encoding.ids) - want][0]
    cut = text.rfind("\n", 0, start) + 1  # 0 when the text has no earlier line: all held out
    # The text's own tokens before the cut: encoding that part again costs as much as the whole.
    train_ids = [t for t, (_, end) in zip(encoding.ids, encoding.offsets) if end <= cut]
    if len(train_ids) < settings.seq_len + 1:
        raise ValueError(f"training text {source}: too few lines to hold {want} tokens out")
    heldout = text[cut:]
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Corpus(train_ids, heldout, tokenizer.encode(heldout).ids, source, digest)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Learning rate of 0-based `step`: linear warm-up to lr, then cosine down to lr x min_lr_fraction."""
    warmup = max(1, round(settings.steps * settings.warmup_fraction))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    done = (step - warmup) / max(1, settings.steps - warmup)
    floor = settings.min_lr_fraction
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done)))


def train(
    model: Any,
    corpus: Corpus,
    settings: TrainSettings,
    seed: int,
    stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Train `model` (float32) in place for settings.steps steps; return the log training.json holds.

    Sequences are windows of seq_len + 1 tokens at seeded random offsets of the training ids.
    `stage` receives a line every ~10% of the steps: step, mean loss and tokens/s since the last.
    """
    import torch  # here, not at module level: `moe-mesh probe` and friends must start fast

    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(corpus.train_ids, dtype=torch.long)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        fused=True,  # one pass over the weights: a third of the unfused step's time on `small`
    )
    stage(
        f"training {settings.steps} steps of {settings.batch} x {settings.seq_len} tokens on "
        f"{len(corpus.train_ids)} tokens of {corpus.source}"
    )
    heldout_before = heldout_loss(model, corpus.heldout_ids, settings)
    every = max(1, settings.steps // 10)
    losses: list[float] = []
    model.train()
    started = last = time.perf_counter()
    for step in range(settings.steps):
        offsets = torch.randint(
            0, len(ids) - settings.seq_len, (settings.batch,), generator=generator
        )
        batch = torch.stack([ids[o : o + settings.seq_len + 1] for o in offsets.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        # [batch, seq_len + 1] -> scalars
        loss, balance = batch_loss(model, batch, settings.balance_coef, settings.router_z_coef)
        (loss + balance).backward()
        torch.nn.utils.clip_grad_norm_(params, settings.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % every == 0 or step + 1 == settings.steps:
            now = time.perf_counter()
            done = (step % every) + 1  # steps since the last line
            stage(
                f"step {step + 1}/{settings.steps}: loss {sum(losses[-done:]) / done:.3f}, "
                f"{settings.batch * settings.seq_len * done / (now - last):.0f} tokens/s"
            )
            last = now
    model.eval()
    heldout_after = heldout_loss(model, corpus.heldout_ids, settings)
    stage(
        f"trained {settings.steps} steps in {time.perf_counter() - started:.0f} s; held-out loss "
        f"{heldout_before:.3f} -> {heldout_after:.3f} ({len(corpus.heldout_ids)} tokens held out)"
    )
    return {
        "settings": asdict(settings),
        "seed": seed,
        "text": corpus.source,
        "text_sha256": corpus.sha256,
        "train_tokens": len(corpus.train_ids),
        "heldout_tokens": len(corpus.heldout_ids),
        "heldout_loss": {"before": heldout_before, "after": heldout_after},
        "loss": losses,
    }


def batch_loss(
    model: Any, batch: Any, balance_coef: float = 0.0, router_z_coef: float = 0.0
) -> tuple[Any, Any]:
    """(mean next-token cross-entropy of [batch, seq_len + 1] token windows, the routers' losses:
    balance_coef x load-balancing loss + router_z_coef x z-loss when training, else 0)."""
    import torch.nn.functional as F  # here: see train

    balance = (balance_coef > 0 or router_z_coef > 0) and model.training
    out = model(input_ids=batch[:, :-1], **({"output_router_logits": True} if balance else {}))
    logits = out.logits  # [batch, seq_len, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    routers = [r for r in getattr(out, "router_logits", None) or () if r is not None]
    if not (balance and routers):
        return loss, 0.0
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None) or config.ffn_config.moe_top_k
    z = sum((r.float().logsumexp(-1) ** 2).mean() for r in routers) / len(routers)
    return loss, balance_coef * balance_loss(routers, top_k) + router_z_coef * z


def balance_loss(router_logits: Sequence[Any], top_k: int) -> Any:
    """Switch Transformer's load-balancing loss (experts x sum of share of the top-k slots x mean
    probability) of each MoE layer, averaged: top_k when balanced. transformers' own pools the layers'
    shares, which lets every layer collapse onto a few experts as long as they are different ones.
    For the sigmoid routers (deepseek_v3, glm4_moe) the logits' softmax stands in for their scores."""
    import torch  # here: see train

    losses = []
    for logits in router_logits:
        probs = logits.reshape(-1, logits.shape[-1]).float().softmax(-1)  # [tokens, experts]
        chosen = probs.topk(top_k, dim=-1).indices.flatten()  # [tokens * top_k]
        share = torch.bincount(chosen, minlength=probs.shape[1]).float() / probs.shape[0]
        losses.append(probs.shape[1] * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def heldout_loss(model: Any, heldout_ids: Sequence[int], settings: TrainSettings) -> float:
    """Mean next-token loss on the first eval_tokens held-out tokens, in seq_len + 1 windows."""
    import torch  # here: see train

    ids = torch.tensor(list(heldout_ids[: settings.eval_tokens + 1]), dtype=torch.long)
    width = min(settings.seq_len, len(ids) - 1)
    n = (len(ids) - 1) // width
    windows = torch.stack(
        [ids[i * width : (i + 1) * width + 1] for i in range(n)]
    )  # [n, width + 1]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = batch_loss(model, windows)[0].item()
    model.train(was_training)
    return loss


def write_outputs(out_dir: Path, corpus: Corpus, log: dict[str, Any]) -> None:
    """heldout.txt (the held-out text, as it was) and training.json (settings, losses)."""
    (out_dir / HELDOUT_FILE).write_text(corpus.heldout_text, encoding="utf-8")
    (out_dir / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
