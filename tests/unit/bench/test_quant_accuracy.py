"""bench/quant_accuracy.py on a briefly trained tiny model: the formats' accuracy within bounds.

The bounds. Trained 100 steps on the project's docs, the tiny Mixtral's next-token distributions
are far from uniform (held-out entropy 5.2-5.3 nats against ln 512 = 6.2; 40 steps leave 6.0).
Measured over 512 held-out tokens with seeds 0-7 (the docs of 2026-11-29): int8 experts
99.6-100% top-1 agreement with bfloat16, mean KL at most 1.1e-5 nats; int4 in groups of 32,
94.3-100% and at most 1.6e-4; every linear layer in int4, 92.4-100% and at most 3.4e-4. A few
near-ties decide the agreement of so small a model, and which ones come up moves with the docs'
text (seed 0 gave 100% for int4 before an edit to them, 94.3% after), so it is held loosely and
the KL, which every token weighs, tightly: int8 at least 98% and under 1e-4, int4 at least 90%
and under 2e-3, and int4 further from bfloat16 than int8 (the `small` model's figures, larger,
are in docs/performance.md).
"""

from __future__ import annotations

import json
import math

import pytest

from bench import quant_accuracy
from common import bf16

pytestmark = pytest.mark.skipif(
    bf16.kernel("moe_silu_ffns") is None, reason="no C compiler or no AVX2: no quantized kernels"
)


def test_quantized_experts_stay_close_to_bfloat16_on_a_trained_model(checkpoint, tmp_path):
    path = checkpoint("mixtral", train_steps=100)
    out = tmp_path / "accuracy.json"
    argv = ["--checkpoint", str(path), "--out", str(out), "--tokens", "512"]
    assert quant_accuracy.main([*argv, "--formats", "int8,int4-g32,int4-g32-all"]) == 0
    result = json.loads(out.read_text())
    rows = {r["format"]: r for r in result["rows"]}
    assert result["entropy"] < 0.9 * math.log(512)  # trained: the test can fail
    assert rows["int8"]["top1_agreement"] >= 0.98 and rows["int8"]["mean_kl"] < 1e-4
    assert rows["int4-g32"]["top1_agreement"] >= 0.90 and rows["int4-g32"]["mean_kl"] < 2e-3
    assert rows["int8"]["mean_kl"] < rows["int4-g32"]["mean_kl"] < rows["int4-g32-all"]["mean_kl"]
    assert all(r["weights"] > 0 for r in rows.values())
