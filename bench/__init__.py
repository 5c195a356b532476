"""Benchmarks, run from the checkout root as `python -m bench.<name>` (`make bench` runs them all);
they share tests/support/ with the tests as `tests.support`. JSON goes to bench/results/."""


def write_result(path, result: dict) -> None:
    """`result` plus the run's torch version, threads and machine, as JSON at `path`."""
    import json
    import platform

    import torch  # here, not at the top: each bench configures OpenMP before torch loads

    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    path.write_text(json.dumps({**result, **run, "machine": platform.machine()}, indent=2))
    print(f"wrote {path}")
