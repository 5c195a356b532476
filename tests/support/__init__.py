"""What tests share: checkpoint factories, in-process and multi-process meshes, the reference prompts
and outputs, fakes, and polling helpers. No test module imports another; benchmarks import none of
this (what they share with tests is product code: moe_mesh/local/processes.py, moe_mesh/benchmark/)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: tests/support/ -> tests/ -> root
