"""The `moe-mesh` command line, run as a user would: a subprocess of the installed console script
(generate, plan, placement show) or of `python` (the deploy probe a container health check runs)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.server import GrpcServer
from common.tokenizer import Tokenizer
from moe_mesh.local.processes import ServiceProcess
from moe_mesh.planning import deploy
from tests.support import REPO
from tests.support.cli import moe_mesh
from tests.support.net import bound_port
from tests.support.plans import EXAMPLE_PLAN, MIB, skewed, write_record


def test_generate_local_json_with_token_ids(checkpoint) -> None:
    path = checkpoint("olmoe")
    r = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt-token-ids",
        "11,3,250,9",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert out["text"] == Tokenizer(path).decode(out["token_ids"])


def test_generate_local_streams_text_for_a_prompt(checkpoint) -> None:
    path = checkpoint("mixtral")
    streamed = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt",
        "Hello wörld",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    as_json = moe_mesh(
        "generate",
        "--checkpoint",
        path,
        "--local",
        "--prompt",
        "Hello wörld",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"]
    assert "[length] 6 tokens" in streamed.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "max_tokens: must be >= 1"),
        (["--max-tokens", "100000"], "max_tokens: prompt (2 tokens) + max_tokens (100000) exceeds"),
        (["--top-p", "0"], "top_p: must be in (0, 1]"),
        (["--min-p", "2"], "min_p: must be in [0, 1], got 2.0"),
        (["--temperature", "-1"], "temperature: must be >= 0, got -1.0"),
    ],
)
def test_generate_bad_input_exits_2_naming_the_field(checkpoint, args, message) -> None:
    r = moe_mesh(
        "generate",
        "--checkpoint",
        checkpoint("mixtral"),
        "--local",
        "--prompt-token-ids",
        "1,2",
        *args,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_generate_needs_exactly_one_prompt_source(checkpoint) -> None:
    both = moe_mesh(
        "generate",
        "--checkpoint",
        checkpoint("mixtral"),
        "--local",
        "--prompt",
        "x",
        "--prompt-token-ids",
        "1",
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    bad_ids = moe_mesh(
        "generate", "--checkpoint", checkpoint("mixtral"), "--local", "--prompt-token-ids", "1,x"
    )
    assert bad_ids.returncode == 2 and "comma-separated integers" in bad_ids.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path) -> None:
    r = moe_mesh("generate", "--checkpoint", tmp_path / "nope", "--local", "--prompt", "x")
    assert r.returncode == 2 and "checkpoint directory not found" in r.stderr and "nope" in r.stderr


def test_serve_router_with_a_kv_budget_too_small_for_one_sequence_exits_2_naming_it(
    checkpoint,
) -> None:
    r = moe_mesh("serve-router", "--checkpoint", checkpoint("mixtral"), "--kv-cache-bytes", "64KiB")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error: kv_cache_bytes: '64KiB' (65536 bytes) holds" in r.stderr
    assert "fewer than one sequence of max_model_len=" in r.stderr


def test_serve_expert_on_a_taken_port_says_so_in_one_line(checkpoint) -> None:
    with bound_port(listen=True) as port:
        # As a user's shell has it: this test process set GRPC_VERBOSITY itself (runtime.configure).
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        r = subprocess.run(
            [sys.executable, "-m", "moe_mesh", "serve-expert", "--checkpoint", checkpoint("mixtral"),
             "--experts", "*:0", "--port", str(port)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    # One line: ours, not gRPC core's own ("E1126 ... add_port.cc] Failed to add port") before it.
    [line] = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert line.startswith("moe-mesh serve-expert: error: cannot listen on 127.0.0.1:"), r.stderr
    assert "add_port" not in r.stderr, r.stderr


def test_placement_show_errors_exit_2_with_a_message(tmp_path) -> None:
    missing = moe_mesh("placement", "show", "--ready-file", tmp_path / "nope.json")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        missing.stderr.startswith("moe-mesh placement show: error: --ready-file:")
        and "does not exist" in missing.stderr
    )
    bad = moe_mesh("placement", "show", "--router", "no-port")
    assert (
        bad.returncode == 2 and "expected HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr
    )
    down = moe_mesh("placement", "show", "--router", "127.0.0.1:1")
    assert down.returncode == 2 and "Traceback" not in down.stderr
    assert (
        "moe-mesh placement show: error: no router answered Status: 127.0.0.1:1 (UNAVAILABLE)"
        in down.stderr
    )


def test_placement_show_json_of_a_live_router(checkpoint, tmp_path) -> None:
    path = checkpoint("olmoe")
    router = ServiceProcess(
        "router_service", ["--checkpoint", str(path)], tmp_path, "router"
    )  # all colocated
    try:
        router.wait_ready()
        r = moe_mesh("placement", "show", "--router", router.address, "--json")
        assert r.returncode == 0, r.stderr
        record = json.loads(r.stdout)
        layers, experts = record["num_layers"], record["num_experts"]
        assert (
            layers > 0
            and experts > 0
            and [r["address"] for r in record["routers"]] == [router.address]
        )
        assert len(record["tokens_routed"]) == len(record["utilization"]) == layers
        assert all(len(row) == experts for row in record["utilization"] + record["tokens_routed"])
        assert record["services"] == [] and record["routers"][0]["colocated"]
        table = moe_mesh("placement", "show", "--router", router.address)
        assert table.returncode == 0 and router.address in table.stdout, table.stderr
    finally:
        router.stop()


def test_plan_prints_the_plan_to_stdout(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_mesh",
            "plan",
            "--utilization",
            str(write_record(tmp_path, skewed())),
            "--base",
            str(EXAMPLE_PLAN),
            "--budget",
            "2MiB",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (tmp_path / "out.yaml").write_text(done.stdout)
    plan = deploy.load_plan(tmp_path / "out.yaml")
    assert plan.router.colocate_budget == str(2 * MIB) and plan.router.args == []
    assert (
        "colocated in the router: 0:1; 1:2  (2 experts, 2.0 MiB of the 2.0 MiB budget)"
        in done.stderr
    )


def test_plan_error_has_no_traceback(tmp_path: Path) -> None:
    record = write_record(tmp_path, skewed(), window_s="soon")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_mesh",
            "plan",
            "--utilization",
            str(record),
            "--base",
            str(tmp_path / "missing.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr
        == f"moe-mesh plan: error: {record}: window_s: expected a number >= 0, got 'soon'\n"
    )


async def test_deploy_probe_as_a_process_without_torch(closed_port) -> None:
    """What a container health check runs: a fresh process that never imports torch."""
    script = (
        "import sys; from moe_mesh.planning import deploy; code = deploy.main(['probe', sys.argv[1]]); "
        "print('torch' in sys.modules); sys.exit(code)"
    )

    async def run(address: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            address,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
        return proc.returncode, out.decode(), err.decode()

    server = GrpcServer([], grace_s=0.1)  # the health service only
    await server.start()
    try:
        code, out, _ = await run(server.address)
    finally:
        await server.stop()
    assert code == 0 and out.splitlines() == [f"{server.address}: SERVING", "False"]
    code, _, err = await run(f"127.0.0.1:{closed_port}")
    assert code == 1 and "UNAVAILABLE" in err


def hub_cache(tmp_path: Path, checkpoint_dir: Path, repo: str = "moe-mesh/tiny-mixtral") -> Path:
    """A Hugging Face hub cache holding `checkpoint_dir` as `repo` at main, laid out as the hub lays
    it out (models--org--name/refs/main -> snapshots/<commit>/...)."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in checkpoint_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    return cache


def test_checkpoint_may_be_a_hugging_face_model_id_resolved_offline(checkpoint, tmp_path) -> None:
    path = checkpoint("mixtral")
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache(tmp_path, path)), "HF_HUB_OFFLINE": "1"}
    args = [
        "--local",
        "--prompt-token-ids",
        "11,3,250,9",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]
    by_dir = moe_mesh("generate", "--checkpoint", path, *args, "--json")
    by_id = subprocess.run(
        [sys.executable, "-m", "moe_mesh", "generate", "--checkpoint", "moe-mesh/tiny-mixtral"]
        + [*args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert by_id.returncode == 0, by_id.stderr
    assert json.loads(by_id.stdout)["token_ids"] == json.loads(by_dir.stdout)["token_ids"]
    missing = subprocess.run(
        [sys.executable, "-m", "moe_mesh", "generate", "--checkpoint", "moe-mesh/absent", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode == 2 and "neither a directory nor a model" in missing.stderr
    assert "Traceback" not in missing.stderr
