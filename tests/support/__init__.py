"""What tests and benchmarks share: checkpoint factories, in-process and multi-process meshes, the
reference prompts and outputs, fakes, and polling helpers. No test module imports another."""
