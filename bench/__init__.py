"""Benchmarks, run from the checkout root as `python -m bench.<name>` (`make bench` runs them all);
they share tests/support/ with the tests as `tests.support`. JSON goes to bench/results/."""
