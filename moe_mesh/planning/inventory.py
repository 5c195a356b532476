"""Node inventories for `moe-mesh plan --search`: the kinds of machines a deployment may use.

    kinds:
      - name: this-machine      # also the Nomad node class the plan constrains groups to
        cores: 2                # CPU cores processes on the node share
        accelerators: 0         # recorded; the CPU profile does not use them
        memory: 24GiB           # router weights + expert weights placed on one node must fit
        cost_per_hour: 0.10     # any currency, the same for every kind
        available: 1            # nodes of this kind the search may use

deploy/inventory.example.yaml is an example. Unknown keys are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.units import parse_size
from moe_mesh.planning.deploy.plan import PlanError, invalid


class NodeKind(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$", description="node kind / Nomad node class")
    cores: int = Field(ge=1, le=4096)
    accelerators: int = Field(0, ge=0)
    memory: Annotated[str, Field(description="bytes: 24GiB, 64GB, 1073741824")]
    cost_per_hour: float = Field(ge=0, allow_inf_nan=False)
    available: int = Field(1, ge=1, le=1024, description="nodes of this kind")

    @field_validator("memory", mode="before")
    @classmethod
    def _size(cls, v: object) -> str:
        text = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(text, str) or text.endswith("%"):
            raise ValueError(f"expected a size such as 24GiB, got {v!r}")
        parse_size(text)  # ValueError says what is accepted
        return text

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory)


class Inventory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: list[NodeKind] = Field(min_length=1)

    @field_validator("kinds")
    @classmethod
    def _unique(cls, kinds: list[NodeKind]) -> list[NodeKind]:
        names = [k.name for k in kinds]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"duplicate kind name {name!r}; names must be unique")
        return kinds


def load_inventory(path: Path) -> Inventory:
    """Read and check an inventory; every problem is a PlanError 'FILE: field.path: message'."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read the inventory ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise PlanError(
            f"{path}: expected a mapping with `kinds:` (see moe_mesh/planning/inventory.py)"
        )
    try:
        return Inventory.model_validate(raw)
    except ValidationError as e:
        raise invalid(path, e) from None
