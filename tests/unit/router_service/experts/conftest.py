"""The mixtral layer the dispatcher and replica tests route through."""

import pytest

from common.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def model(checkpoint):
    """(spec, layer 0's dense weights, every expert's weights) of the tiny Mixtral."""
    ckpt = Checkpoint(checkpoint("mixtral"))
    return ckpt.spec, ckpt.load_dense().layers[0], ckpt.load_experts(ckpt.all_expert_pairs())
