"""What tests and benchmarks share: checkpoint factories, in-process and multi-process meshes, the
reference prompts and outputs, fakes, and polling helpers. No test module imports another."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: tests/support/ -> tests/ -> root
