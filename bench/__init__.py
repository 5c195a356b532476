"""Benchmarks, run from the checkout root as `python -m bench.<name>` (`make bench` runs them all);
they share tests/support/ with the tests as `tests.support`. JSON goes to bench/results/."""

import argparse
from pathlib import Path

DEFAULT_CHECKPOINT = Path(".cache/bench-small-mixtral")


def parser_with_checkpoint(doc: str | None) -> argparse.ArgumentParser:
    """A bench's argument parser, with --checkpoint (default: the `small` Mixtral bench checkpoint)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=DEFAULT_CHECKPOINT,
        help="checkpoint to use; the default is created (small Mixtral) if missing",
    )
    return parser


def ensure_checkpoint(path: Path) -> None:
    """Create the `small` Mixtral at `path` (seed 0, with progress) unless a checkpoint is there."""
    if not (path / "config.json").exists():
        # Here, not at the top: each bench configures OpenMP before torch loads.
        from moe_mesh.dev.create_checkpoint import create_checkpoint

        create_checkpoint(path, "mixtral", "small", seed=0, progress=True)


def write_result(path, result: dict) -> None:
    """`result` plus the run's torch version, threads and machine, as JSON at `path`."""
    import json
    import platform

    import torch  # here, not at the top: each bench configures OpenMP before torch loads

    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    path.write_text(json.dumps({**result, **run, "machine": platform.machine()}, indent=2))
    print(f"wrote {path}")
