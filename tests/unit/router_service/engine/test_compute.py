"""The router's compute thread computes with its creator's thread count, whatever torch's
setting became since."""

from __future__ import annotations

import asyncio

import torch

from router_service.engine.compute import ComputeThread


def test_the_compute_thread_keeps_the_thread_count_it_was_made_with() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    compute = ComputeThread()
    torch.set_num_threads(1)  # e.g. a serial pass elsewhere: new threads would start with 1
    try:
        assert asyncio.run(compute(torch.get_num_threads)) == 2
        compute.release_openmp_threads()
        assert asyncio.run(compute(torch.get_num_threads)) == 2
    finally:
        compute.close()
        torch.set_num_threads(before)
