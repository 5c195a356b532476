"""moe-mesh: one import namespace for the whole product.

The composition root (the `moe-mesh` CLI, local launcher, operator views, planning, developer
tools) lives in this folder. The services and shared code keep their own top-level folders
(`common/`, `protos/`, `router_service/`, `expert_service/`, `gateway/`) and import as
`moe_mesh.common`, `moe_mesh.gateway`, ...: an installed wheel places them under this package
(pyproject's package-dir), and in a source checkout the checkout root is added to this package's
path below, so a worktree run with PYTHONPATH=. imports its own copy of every folder.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "router_service").is_dir():
    __path__.append(str(_checkout))
