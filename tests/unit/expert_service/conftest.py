from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest

from expert_service.settings import ExpertSettings
from tests.support.experts import expert_settings


@pytest.fixture
def settings(checkpoint) -> Callable[..., ExpertSettings]:
    """settings(**overrides) -> ExpertSettings of a service for SPEC of the ARCH checkpoint."""
    return partial(expert_settings, checkpoint)
