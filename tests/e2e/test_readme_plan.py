"""README.md's "From measured load to a deployment" commands, run verbatim on the tiny checkpoint:
a mesh up, load through it, the window recorded, a quick profile, `plan`, `plan --search` and
`deploy render`. Only the checkpoint path is substituted (the README's is what `make demo`
creates)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from moe_mesh.planning import deploy
from moe_mesh.planning.profile_format import read_profile
from moe_mesh.planning.record import read_record
from tests.support import REPO

SECTION = "## From measured load to a deployment"


def readme_block() -> str:
    """The first fenced `sh` block of the README's section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"no ```sh block under {SECTION!r}"
    return match.group(1)


def test_the_readme_block_is_what_this_test_runs() -> None:
    block = readme_block()
    assert block.startswith("CHECKPOINT=.cache/demo-small-mixtral\n")  # what `make demo` creates
    for command in ("moe-mesh plan --utilization", "moe-mesh plan --search", "deploy render"):
        assert command in block


def run_block(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """bash -e over the block in its own session: whatever it leaves running (the mesh, if a step
    fails) is stopped with it."""
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        out = "timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_readme_plan_commands_run_verbatim(checkpoint, tmp_path: Path) -> None:
    path = checkpoint("mixtral")
    script, count = re.subn(r"^CHECKPOINT=.*$", f"CHECKPOINT={path}", readme_block(), flags=re.M)
    assert count == 1
    # The README runs from the repository: its .venv (this interpreter's) and deploy/ examples.
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    done = run_block(script, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]

    record = read_record(tmp_path / "window.json")
    assert record.model_id == path.name and sum(record.load.values()) > 0
    assert read_profile(tmp_path / "profile.json").model_id == path.name
    for name in ("plan.yaml", "searched.yaml"):
        plan = deploy.load_plan(tmp_path / name)  # valid, every MoE expert covered
        assert plan.model.model_id == path.name and plan.model.num_layers == record.num_layers
        weights = [len(deploy.expert_pairs(g.experts)) for g in plan.expert_groups]
        # Memory from the bytes each group holds (and 512 MiB for the process)
        assert [g.resources.memory_mb for g in plan.expert_groups] == [
            -(-n * record.expert_bytes // 2**20) + 512 for n in weights
        ]
    assert done.stdout.count("the plan asks for ") == 2
    assert "on 1 node(s): this-machine x1" in done.stdout
    assert (tmp_path / "rendered" / "docker-compose.yml").is_file()
