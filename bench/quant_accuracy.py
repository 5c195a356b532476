"""How far int8 and int4 experts move a model's next-token distributions from bfloat16 ones.

transformers scores one teacher-forced text (`--text`, default the checkpoint's heldout.txt, which
`moe-mesh checkpoint create --train-steps N` writes: text the model did not train on) in float32
with the model's weights as bfloat16 holds them, then again with its routed experts (with
`-all` formats: every linear layer but the gates) replaced by what each quantized format holds:
moe-mesh's own quantizer and layout (common/quant.py), read back and dequantized. The kernels
compute those weights' products to float accuracy (tests/unit/common/test_quant.py), so this is
the formats' accuracy, apart from bfloat16 activations, which both sides would share.

Per format: next-token top-1 agreement with bfloat16 over the text's positions, and the mean
KL(bfloat16 || quantized) of the next-token distributions, in nats. Use a trained checkpoint: a
random one's distributions are near uniform and say little.

    .venv/bin/python -m bench.quant_accuracy --checkpoint DIR [--tokens 512]
        [--formats int8,int4-g32,int4-g64,int4-g128]
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from bench import ScriptSettings, parse_settings, write_result
from common.quant import Quantization, QuantPanels, dequantize, unpack

ROUTERS = (".gate.weight", "shared_expert_gate.weight", ".router.weight")


class Settings(ScriptSettings):
    out: Path = Field(Path("bench/results/quant_accuracy.json"), description="the JSON result")
    text: Path | None = Field(None, description="the text scored; default CHECKPOINT/heldout.txt")
    tokens: int = Field(512, ge=16, description="tokens of the text scored")
    formats: str = Field(
        "int8,int4-g32,int4-g64,int4-g128,int8-all,int4-g64-all",
        description="comma-separated formats: int8, int4-gN; -all: every linear layer, not only experts",
    )


def parse_format(name: str) -> tuple[Quantization, bool]:
    base = name.removesuffix("-all")
    if base == "int8":
        return Quantization("int8"), name.endswith("-all")
    return Quantization("int4", int(base.removeprefix("int4-g"))), name.endswith("-all")


def held(weight: torch.Tensor, q: Quantization) -> torch.Tensor:
    """What the format holds for `weight` [out, in] (or fused experts' [E, out, in]), float32."""
    if weight.dim() == 3:
        return torch.stack([held(w, q) for w in weight])
    p = QuantPanels(weight.bfloat16(), q)
    values, scales = unpack(p.data, p.scales, tuple(weight.shape), q)
    return dequantize(values, scales, q).float()


def quantized_names(model, q: Quantization, everything: bool) -> list[str]:
    """The decoder layers' weights the format replaces: the routed experts' (every linear one's
    but the gates' with `everything`), where the format can hold their shape."""
    names = []
    for name, param in model.named_parameters():
        if param.dim() not in (2, 3) or not name.startswith("model.layers."):
            continue
        if name.endswith(ROUTERS) or not q.fits(tuple(param.shape[-2:])):
            continue
        if everything or ".experts." in name:
            names.append(name)
    return names


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_settings(Settings, __doc__, argv)
    text = (args.text or args.checkpoint / "heldout.txt").read_text()
    ids = AutoTokenizer.from_pretrained(args.checkpoint)(text)["input_ids"][: args.tokens]
    if len(ids) < args.tokens:
        print(f"note: the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    for p in params.values():  # the model as bfloat16 holds it: the baseline
        p.copy_(p.bfloat16().float())
    original = {n: p.clone() for n, p in params.items()}
    batch = torch.tensor([ids])
    base = torch.log_softmax(model(batch).logits[0].float(), dim=-1)
    rows = []
    for name in args.formats.split(","):
        q, everything = parse_format(name)
        names = quantized_names(model, q, everything)
        for n in names:
            params[n].copy_(held(original[n], q))
        logp = torch.log_softmax(model(batch).logits[0].float(), dim=-1)
        for n in names:
            params[n].copy_(original[n])
        agreement = float((logp.argmax(-1) == base.argmax(-1)).float().mean())
        kl = float((base.exp() * (base - logp)).sum(-1).mean())
        rows.append(
            {"format": name, "weights": len(names), "top1_agreement": agreement, "mean_kl": kl}
        )
        print(f"{name:>14}: top-1 agreement {agreement:.1%}, mean KL {kl:.5f} nats", flush=True)
    entropy = float(-(base.exp() * base).sum(-1).mean())
    print(f"bfloat16's mean next-token entropy: {entropy:.3f} nats over {len(ids)} tokens")
    write_result(
        args.out,
        {"checkpoint": str(args.checkpoint), "tokens": len(ids), "entropy": entropy, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
