"""`moe-mesh deploy render` (compose and Nomad, checked offline against the plan) and `moe-mesh probe`."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health_pb2
from hcl2.utils import SerializationOptions

from common.server import GrpcServer
from moe_mesh.planning import deploy
from tests.support import REPO

EXAMPLE_PLAN = REPO / "deploy" / "plan.example.yaml"
COMMITTED = {t: REPO / "deploy" / t for t in ("compose", "nomad", "kubernetes")}
COMPOSE_SCHEMA = REPO / "deploy" / "schema" / "compose-spec.json"
HCL_OPTIONS = SerializationOptions(
    explicit_blocks=False, strip_string_quotes=True, with_comments=False
)


def example_raw() -> dict:
    return yaml.safe_load(EXAMPLE_PLAN.read_text())


def plan_of(raw: dict, tmp_path: Path) -> deploy.Plan:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return deploy.load_plan(path)


def a_plan(tmp_path: Path) -> deploy.Plan:
    """A plan unlike the example: three groups, several gateways, a '$' in a flag, no regions on one
    group, no `security` (the example has it)."""
    raw = example_raw()
    raw.pop("security")
    raw["name"] = "mesh"
    raw["gateway"]["replicas"] = 2
    raw["router"] = {
        "replicas": 3,
        "port": 6000,
        "region": "eu",
        "datacenters": ["eu-1", "eu-2"],
        "args": ["--max-num-seqs", "64"],
    }
    raw["expert_groups"] = [
        {
            "name": "a",
            "experts": "*:0-1",
            "replicas": 3,
            "region": "eu",
            "port": 7001,
            "constraints": [{"attribute": "${meta.gpu}", "operator": "!=", "value": "none"}],
        },
        {
            "name": "b",
            "experts": "0-3:2-5; 4-7:2-5",
            "replicas": 1,
            "datacenters": ["dc9"],
            "quantize": "int4",  # a cold group
            "quantize_group_size": 32,
        },
        {
            "name": "c-tail",
            "experts": "*:6,7",
            "replicas": 2,
            "region": "us",
            "args": ["--model-id-note=$HOME"],
        },
    ]
    return plan_of(raw, tmp_path)


# ------------------------------------------------------------------------------------------ plans


def test_example_plan_validates() -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    assert [g.name for g in plan.expert_groups] == ["hot", "cold"]
    assert plan.model.num_layers == 8 and plan.model.num_experts == 8


def test_expert_pairs_uses_the_services_grammar() -> None:
    assert deploy.expert_pairs("*:0-1", 2, 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert deploy.expert_pairs("3:7; 0-1:2") == [
        (0, 2),
        (1, 2),
        (3, 7),
    ]  # syntax only: bounds from the text
    with pytest.raises(ValueError, match="is not N or A-B"):
        deploy.expert_pairs("*:a")


def _set(path: str, value):
    def mutate(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()

BAD_PLANS = [
    (
        _set("expert_groups.0.replicas", 0),
        "expert_groups[0].replicas: Input should be greater than or equal to 1",
    ),
    (
        _set("expert_groups.1.experts", "*:x"),
        "expert_groups[1].experts: expert 'x' in '*:x' is not N or A-B",
    ),
    (
        _set("expert_groups.1.experts", "0-3"),
        "expert_groups[1].experts: item '0-3' is not LAYERS:EXPERTS",
    ),
    (_set("expert_groups.1.name", "hot"), "expert_groups: duplicate group name 'hot'"),
    (_set("expert_groups.1", _DELETE), "expert_groups: no group serves '0-7:4-7'"),
    (
        _set("expert_groups.0.experts", "*:0-8"),
        "expert_groups: group 'hot' experts '*:0-8': expert '0-8'",
    ),
    (_set("expert_groups.0.name", "Hot_1"), "expert_groups[0].name: String should match pattern"),
    (_set("expert_groups", []), "expert_groups: List should have at least 1 item"),
    (_set("expert_group", []), "expert_group: Extra inputs are not permitted"),
    (_set("image", _DELETE), "image: Field required"),
    (_set("model.checkpoint", "models/x"), "model.checkpoint: must be an absolute directory path"),
    (_set("model.num_experts", _DELETE), "model: give both num_layers and num_experts"),
    (_set("gateway.http_port", 50050), "gateway: grpc_port and http_port are both 50050"),
    (_set("router.replicas", "two"), "router.replicas: Input should be a valid integer"),
    (
        _set("router.args", ["--colocate-budget", "1GiB"]),
        "router.args: set router.colocate_budget instead of --colocate-budget",
    ),
    (
        _set("router", {"max_num_seqs": 8, "args": ["--max-num-seqs=8"]}),
        "router: router.max_num_seqs is set and router.args has --max-num-seqs: keep one",
    ),
    (
        _set("router", {"micro_batches": "auto", "args": ["--micro-batches", "2"]}),
        "router: router.micro_batches is set and router.args has --micro-batches: keep one",
    ),
    (_set("router.micro_batches", 9), "router.micro_batches"),
    (_set("router.micro_batches", "many"), "router.micro_batches"),
    (_set("router.max_num_seqs", 0), "router.max_num_seqs: Input should be greater than"),
    (
        _set("expert_groups.0.constraints.0.attribute", ""),
        "expert_groups[0].constraints[0].attribute: String should",
    ),
]


@pytest.mark.parametrize("mutate, message", BAD_PLANS, ids=[m for _, m in BAD_PLANS])
def test_bad_plan_names_the_field(tmp_path: Path, mutate, message: str) -> None:
    raw = example_raw()
    mutate(raw)
    with pytest.raises(deploy.PlanError) as e:
        plan_of(raw, tmp_path)
    assert message in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'plan.yaml'}: ")


@pytest.mark.parametrize(
    "text, message", [("image: [", "not valid YAML"), ("- a\n- b\n", "expected a mapping")]
)
def test_unreadable_plan(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "plan.yaml").write_text(text)
    with pytest.raises(deploy.PlanError, match=message):
        deploy.load_plan(tmp_path / "plan.yaml")
    with pytest.raises(deploy.PlanError, match="cannot read the plan"):
        deploy.load_plan(tmp_path / "missing.yaml")


def test_render_cli_reports_bad_plan_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = example_raw()
    raw["expert_groups"][0]["replicas"] = 0
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(raw))
    code = deploy.main(
        [
            "deploy",
            "render",
            "--plan",
            str(tmp_path / "plan.yaml"),
            "--target",
            "nomad",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    assert "moe-mesh deploy render: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ compose


def _compose(plan: deploy.Plan) -> dict:
    return yaml.safe_load(deploy.render(plan, "compose")["docker-compose.yml"])


def _schema_errors(doc: dict) -> list[str]:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    # The file says "$schema": "http://json-schema.org/draft/2019-09/schema#", a spelling jsonschema
    # does not look up: name the draft instead of letting it guess (and warn).
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


@pytest.mark.parametrize("which", ["example", "other"])
def test_compose_validates_against_the_compose_spec_schema(tmp_path: Path, which: str) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN) if which == "example" else a_plan(tmp_path)
    doc = _compose(plan)
    assert _schema_errors(doc) == []
    broken = copy.deepcopy(doc)  # the schema is strict enough to catch what we could get wrong
    broken["services"]["router"]["deploy"]["replicas"] = "2"
    broken["services"]["gateway"]["depends_on"]["router"]["condition"] = "healthy"
    broken["services"]["consul"]["healtcheck"] = broken["services"]["consul"].pop("healthcheck")
    assert len(_schema_errors(broken)) == 3


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="Debian's docker-compose is not on PATH"
)
@pytest.mark.parametrize("which", ["example", "other"])
def test_compose_passes_docker_compose_config(tmp_path: Path, which: str) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN) if which == "example" else a_plan(tmp_path)
    deploy.write_rendered(deploy.render(plan, "compose"), tmp_path / "out", "compose")
    compose_file = tmp_path / "out" / "docker-compose.yml"
    env = {**os.environ, "MODEL_DIR": str(tmp_path)}
    ok = subprocess.run(
        ["docker-compose", "-f", str(compose_file), "config", "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    env.pop(
        "MODEL_DIR"
    )  # the model mount is mandatory: a missing MODEL_DIR fails before anything starts
    missing = subprocess.run(
        ["docker-compose", "-f", str(compose_file), "config", "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "MODEL_DIR" in missing.stderr


def _after(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, (flag, command)
    return command[command.index(flag) + 1]


def test_compose_services_follow_the_plan(tmp_path: Path) -> None:
    plan = a_plan(tmp_path)
    services = _compose(plan)["services"]
    assert set(services) == {
        "consul",
        "prometheus",
        "gateway",
        "router",
        "expert-a",
        "expert-b",
        "expert-c-tail",
    }
    assert services["consul"]["command"] == ["agent", "-dev", "-client", "0.0.0.0"]
    assert services["consul"]["healthcheck"]["test"][:2] == ["CMD", "consul"]
    moe = {name: s for name, s in services.items() if name not in ("consul", "prometheus")}
    for name, s in moe.items():
        # Metrics on a fixed port for Prometheus, OTLP once an endpoint is set, the component named.
        assert s["command"][-2:] == ["--metrics-port", "9400"] and "9400" in s["expose"]
        env = s["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
        assert env["OTEL_RESOURCE_ATTRIBUTES"].endswith(f"moe_mesh.component={name}")
        assert (
            _after(s["command"], "--registry") == "consul"
            and _after(s["command"], "--host") == "0.0.0.0"
        )
        assert _after(s["command"], "--checkpoint") == plan.model.checkpoint
        assert s["environment"]["CONSUL_HTTP_ADDR"] == "${CONSUL_HTTP_ADDR:-consul:8500}"
        assert s["depends_on"]["consul"] == {"condition": "service_healthy"}
        assert s["volumes"] == [
            f"${{MODEL_DIR:?set MODEL_DIR to the checkpoint directory on this host}}:"
            f"{plan.model.checkpoint}:ro"
        ]
        assert s["image"] == f"${{MOE_MESH_IMAGE:-{plan.image}}}"
        assert s["healthcheck"]["test"][:3] == ["CMD", "moe-mesh", "probe"]
        assert (
            "--expert" not in s["command"] and "--router" not in s["command"]
        )  # discovery goes through Consul
    for g in plan.expert_groups:
        s = services[f"expert-{g.name}"]
        assert s["deploy"]["replicas"] == g.replicas
        assert _after(s["command"], "--experts") == g.experts
        assert _after(s["command"], "--port") == str(g.port) and s["expose"] == [
            str(g.port),
            "9400",
        ]
        size = {"cpus": f"{g.resources.cpu_mhz / 1000:g}", "memory": f"{g.resources.memory_mb}M"}
        assert s["deploy"]["resources"] == {"limits": size, "reservations": size}
        assert s["healthcheck"]["test"] == ["CMD", "moe-mesh", "probe", f"127.0.0.1:{g.port}"]
        assert ("--region" in s["command"]) == bool(g.region)
        if g.region:
            assert _after(s["command"], "--region") == g.region
        assert ("--quantize" in s["command"]) == (g.quantize != "none")
        assert set(s["depends_on"]) == {"consul"}
    b = services["expert-b"]["command"]
    assert (_after(b, "--quantize"), _after(b, "--quantize-group-size")) == ("int4", "32")
    assert (
        services["expert-c-tail"]["command"][-3] == "--model-id-note=$$HOME"
    )  # '$' escaped for compose
    router = services["router"]
    assert router["deploy"]["replicas"] == 3 and _after(router["command"], "--port") == "6000"
    assert router["command"][-4:-2] == ["--max-num-seqs", "64"]
    assert set(router["depends_on"]) == {"consul", "expert-a", "expert-b", "expert-c-tail"}
    assert all(d == {"condition": "service_healthy"} for d in router["depends_on"].values())
    gateway = services["gateway"]
    assert gateway["deploy"]["replicas"] == 2 and set(gateway["depends_on"]) == {"consul", "router"}
    assert gateway["ports"] == ["50050", "8000"]  # several replicas: Docker picks the host ports
    assert _compose(deploy.load_plan(EXAMPLE_PLAN))["services"]["gateway"]["ports"] == [
        "50050:50050",
        "8000:8000",
    ]


# ------------------------------------------------------------------------------------------ nomad


def _jobs(plan: deploy.Plan) -> dict[str, dict]:
    """Job name -> job body, each file parsed by python-hcl2 on its own."""
    jobs = {}
    for name, text in deploy.render(plan, "nomad").items():
        if not name.endswith(".nomad.hcl"):  # prometheus.yml, nomad-autoscaler.hcl
            continue
        [job] = hcl2.loads(text, serialization_options=HCL_OPTIONS)["job"]
        [(job_name, body)] = job.items()
        assert name == f"{job_name}.nomad.hcl"
        jobs[job_name] = body
    return jobs


def _one(body: dict, block: str, label: str | None = None) -> dict:
    [item] = body[block]
    if label is None:
        return item
    [(got, inner)] = item.items()
    assert got == label
    return inner


def _ports(group: dict) -> dict[str, dict]:
    return {label: inner for p in _one(group, "network")["port"] for label, inner in p.items()}


def _services(group: dict) -> dict[str, dict]:
    return {s["name"]: s for s in group["service"]}


def _groups(job: dict) -> dict[str, dict]:
    return {label: inner for g in job["group"] for label, inner in g.items()}


def _check_task(plan: deploy.Plan, group: dict, task: str) -> list[str]:
    t = _one(group, "task", task)
    assert t["driver"] == "docker"
    config = _one(t, "config")
    assert config["image"] == plan.image and config["network_mode"] == "host"
    assert _one(t, "volume_mount") == {
        "volume": "model",
        "destination": plan.model.checkpoint,
        "read_only": True,
    }
    assert _one(group, "volume", "model") == {
        "type": "host",
        "source": plan.nomad.model_volume,
        "read_only": True,
    }
    env = _one(t, "env")
    assert env["CONSUL_HTTP_ADDR"] == plan.nomad.consul_http_addr
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == plan.nomad.otlp_endpoint
    assert env["OTEL_RESOURCE_ATTRIBUTES"].startswith(f"service.namespace={plan.name},")
    args = config["args"]
    # Every task serves metrics on its group's `metrics` port, registered for Prometheus.
    assert args[-2:] == ["--metrics-port", "${NOMAD_PORT_metrics}"]
    assert _ports(group)["metrics"] == {}
    [metrics] = [s for s in group["service"] if s["port"] == "metrics"]
    assert "prometheus" in metrics["tags"] and _one(metrics, "check")["path"] == "/metrics"
    assert (
        args[0] == task
        and _after(args, "--registry") == "consul"
        and _after(args, "--host") == "0.0.0.0"
    )
    assert _after(args, "--checkpoint") == plan.model.checkpoint
    return args


@pytest.mark.parametrize("which", ["example", "other"])
def test_nomad_jobs_parse_and_follow_the_plan(tmp_path: Path, which: str) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN) if which == "example" else a_plan(tmp_path)
    jobs = _jobs(plan)
    assert set(jobs) == {f"{plan.name}-experts-{g.name}" for g in plan.expert_groups} | {
        f"{plan.name}-frontend"
    }
    for g in plan.expert_groups:
        job = jobs[f"{plan.name}-experts-{g.name}"]
        assert job["type"] == "service"
        assert job.get("region") == (g.region or None)
        assert job["datacenters"] == (g.datacenters or plan.nomad.datacenters)
        group = _one(job, "group", "experts")
        assert group["count"] == g.replicas
        assert [
            (c["attribute"], c["operator"], c["value"]) for c in group.get("constraint", [])
        ] == [(c.attribute, c.operator, c.value) for c in g.constraints]
        assert _ports(group)["grpc"] == {}  # Nomad picks the host port
        service = _services(group)[f"{plan.name}-experts-{g.name}"]
        assert (
            service["name"] == f"{plan.name}-experts-{g.name}" and service["provider"] == "consul"
        )
        assert service["port"] == "grpc" and _one(service, "meta")["experts"] == g.experts
        check = _one(service, "check")
        if plan.security.tls:  # `moe-mesh probe` in the task, presenting its certificate
            assert (check["type"], check["task"], check["command"]) == (
                "script",
                "serve-expert",
                "moe-mesh",
            )
            assert _after(check["args"], "--tls-server-name") == plan.security.server_name
        else:
            assert check["type"] == "grpc" and check["port"] == "grpc"
        args = _check_task(plan, group, "serve-expert")
        assert (
            _after(args, "--experts") == g.experts
            and _after(args, "--model-id") == plan.model.model_id
        )
        assert (
            _after(args, "--port") == "${NOMAD_PORT_grpc}"
            and _after(args, "--advertise-host") == "${NOMAD_IP_grpc}"
        )
        assert (_after(args, "--region") if "--region" in args else "") == g.region
        assert args[len(args) - len(g.args) - 2 : -2] == g.args or not g.args
    front = jobs[f"{plan.name}-frontend"]
    assert front.get("region") == (plan.router.region or None)
    assert front["datacenters"] == (plan.router.datacenters or plan.nomad.datacenters)
    groups = _groups(front)
    assert list(groups) == ["router", "gateway"]
    router, gateway = groups["router"], groups["gateway"]
    assert router["count"] == plan.router.replicas and gateway["count"] == plan.gateway.replicas
    kind = "script" if plan.security.tls else "grpc"
    assert _one(_services(router)[f"{plan.name}-routers"], "check")["type"] == kind
    args = _check_task(plan, router, "serve-router")
    assert "--expert" not in args and _after(args, "--port") == "${NOMAD_PORT_grpc}"
    assert _ports(gateway) == {
        "grpc": {"static": plan.gateway.grpc_port},
        "http": {"static": plan.gateway.http_port},
        "metrics": {},
    }
    services = _services(gateway)
    assert set(services) == {
        f"{plan.name}-gateway",
        f"{plan.name}-gateway-http",
        f"{plan.name}-gateway-metrics",
    }
    assert _one(services[f"{plan.name}-gateway"], "check")["type"] == kind
    assert _one(services[f"{plan.name}-gateway-http"], "check")["path"] == "/health/ready"
    args = _check_task(plan, gateway, "serve-gateway")
    assert "--router" not in args and _after(args, "--grpc-port") == str(plan.gateway.grpc_port)


def test_nomad_escapes_plan_strings_but_not_its_own_interpolations(tmp_path: Path) -> None:
    raw = example_raw()
    raw.pop("security")  # its flags would follow the plan's args
    raw["expert_groups"][1]["args"] = ['--note=a"b\\c ${x} %{y}']
    text = deploy.render(plan_of(raw, tmp_path), "nomad")["moe-mesh-experts-cold.nomad.hcl"]
    assert r'"--note=a\"b\\c $${x} %%{y}",' in text
    assert (
        '"${NOMAD_PORT_grpc}"' in text and 'attribute = "${node.class}"' not in text
    )  # cold has no constraint
    [job] = hcl2.loads(text, serialization_options=HCL_OPTIONS)["job"]
    assert (
        job["moe-mesh-experts-cold"]["group"][0]["experts"]["task"][0]["serve-expert"]["config"][0][
            "args"
        ][-3]
        == '--note=a"b\\c $${x} %%{y}'
    )  # HCL keeps the escapes; Nomad turns them back into '${x} %{y}'


# ------------------------------------------------------------------------------------------ render, drift


@pytest.mark.parametrize("target", deploy.TARGETS)
def test_committed_examples_match_a_fresh_render(target: str) -> None:
    files = deploy.render(deploy.load_plan(EXAMPLE_PLAN), target)
    assert deploy.render(deploy.load_plan(EXAMPLE_PLAN), target) == files  # deterministic
    bad = deploy.drifted(files, COMMITTED[target], target)
    assert not bad, (
        f"{', '.join(bad)} in {COMMITTED[target].relative_to(REPO)} differ from the render of "
        f"deploy/plan.example.yaml; re-render: moe-mesh deploy render --plan deploy/plan.example.yaml "
        f"--target {target} --out {COMMITTED[target].relative_to(REPO)}"
    )


def test_render_writes_checks_and_removes_stale_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "nomad"
    plan_path = tmp_path / "plan.yaml"
    raw = example_raw()
    raw["expert_groups"].append({"name": "extra", "experts": "0:0"})
    plan_path.write_text(yaml.safe_dump(raw))
    args = ["deploy", "render", "--plan", str(plan_path), "--target", "nomad", "--out", str(out)]
    assert deploy.main(args) == 0
    assert (out / "moe-mesh-experts-extra.nomad.hcl").exists()
    (out / "notes.nomad.hcl").write_text("# mine\n")  # not rendered by us: left alone
    assert deploy.main([*args, "--check"]) == 1  # notes.nomad.hcl is not part of the render
    (out / "notes.nomad.hcl").unlink()
    assert deploy.main([*args, "--check"]) == 0
    raw["expert_groups"].pop()
    plan_path.write_text(yaml.safe_dump(raw))
    assert deploy.main([*args, "--check"]) == 1
    assert "moe-mesh-experts-extra.nomad.hcl differs" in capsys.readouterr().err
    (out / "keep.nomad.hcl").write_text("# mine\n")
    assert deploy.main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "keep.nomad.hcl",
        "moe-mesh-experts-cold.nomad.hcl",
        "moe-mesh-experts-hot.nomad.hcl",
        "moe-mesh-frontend.nomad.hcl",
        "nomad-autoscaler.hcl",  # the example's hot group autoscales
        "prometheus.yml",
    ]


def test_compose_render_writes_the_env_example_and_no_dockerfile(tmp_path: Path) -> None:
    """The image's Dockerfile is a source file of the repository (deploy/compose/Dockerfile), the
    same for every plan: a render leaves it alone."""
    files = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose")
    assert sorted(files) == [".env.example", "docker-compose.yml", "prometheus.yml"]
    env = dict(
        line.split("=", 1)
        for line in files[".env.example"].splitlines()
        if line and not line.startswith("#")
    )
    assert set(env) == {
        "MODEL_DIR",
        "MOE_MESH_IMAGE",
        "CONSUL_IMAGE",
        "CONSUL_HTTP_ADDR",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_TRACES_SAMPLER_ARG",
        "PROMETHEUS_IMAGE",
    }
    assert env["MOE_MESH_IMAGE"] == "moe-mesh:0.1.0"
    # The example plan is secured: the Consul token is a secret file, not a value here.
    assert "moe-mesh certs --out secrets --host moe-mesh" in files[".env.example"]
    # Every ${VAR} the compose file reads is offered in .env.example.
    used = set(re.findall(r"\$\{([A-Z_]+)[:?}-]", files["docker-compose.yml"]))
    assert used <= set(env) | {"OMP_WAIT_POLICY"}, used - set(env)


# ------------------------------------------------------------------------------------------ probe


@pytest.fixture
async def health_server():
    server = GrpcServer([], grace_s=0.1)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_probe_serving_server_exits_0(health_server: GrpcServer) -> None:
    assert await asyncio.to_thread(deploy.main, ["probe", health_server.address]) == 0
    assert await asyncio.to_thread(deploy.probe, health_server.address) == (True, "SERVING")


async def test_probe_not_serving_or_unknown_service_exits_1(health_server: GrpcServer) -> None:
    assert (
        await asyncio.to_thread(deploy.main, ["probe", health_server.address, "--service", "nope"])
        == 1
    )
    serving, status = await asyncio.to_thread(deploy.probe, health_server.address, "nope")
    assert not serving and status.startswith("NOT_FOUND")
    await health_server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await asyncio.to_thread(deploy.probe, health_server.address) == (False, "NOT_SERVING")
    assert await asyncio.to_thread(deploy.main, ["probe", health_server.address]) == 1


async def test_probe_closed_port_exits_1_quickly(closed_port) -> None:
    """Refused at once, not after its timeout (an hour: past the guard)."""
    probe = ["probe", f"127.0.0.1:{closed_port}", "--timeout-s", "3600"]
    assert await asyncio.wait_for(asyncio.to_thread(deploy.main, probe), 60) == 1


@pytest.mark.parametrize("micro_batches", [3, "auto"])
def test_router_batching_fields_render_as_flags(tmp_path: Path, micro_batches) -> None:
    """max_num_seqs and micro_batches (set by `plan --search`) reach serve-router on both targets;
    a plan without them (every older plan) renders no such flag."""
    raw = example_raw()
    raw["router"].update(max_num_seqs=16, micro_batches=micro_batches)
    plan = plan_of(raw, tmp_path)
    command = _compose(plan)["services"]["router"]["command"]
    assert _after(command, "--max-num-seqs") == "16"
    assert _after(command, "--micro-batches") == str(micro_batches)
    frontend = deploy.render(plan, "nomad")["moe-mesh-frontend.nomad.hcl"]
    assert re.search(r'"--max-num-seqs",\s*"16"', frontend)
    assert re.search(rf'"--micro-batches",\s*"{micro_batches}"', frontend)
    old = _compose(plan_of(example_raw(), tmp_path))["services"]["router"]["command"]
    assert "--max-num-seqs" not in old and "--micro-batches" not in old


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no `promtool` (Debian package prometheus)"
)
def test_the_compose_scrape_configuration_passes_promtool(tmp_path: Path) -> None:
    # Debian's Prometheus is built without Consul and Kubernetes discovery, so only the compose
    # configuration (DNS discovery) can be checked by it here.
    files = deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose")
    (tmp_path / "prometheus.yml").write_text(files["prometheus.yml"])
    r = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="no `docker-compose` (Debian package)"
)
def test_docker_compose_accepts_the_rendered_file(tmp_path: Path) -> None:
    for name, text in deploy.render(deploy.load_plan(EXAMPLE_PLAN), "compose").items():
        (tmp_path / name).write_text(text)
    r = subprocess.run(
        ["docker-compose", "--env-file", ".env.example", "config", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------- kubernetes

K8S_VERSION = "1.37.0"  # kubernetes-validate carries the API schemas of each release offline


def _objects(plan: deploy.Plan) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, from every rendered file."""
    out = {}
    for text in deploy.render(plan, "kubernetes").values():
        for obj in yaml.safe_load_all(text):
            out[obj["kind"], obj["metadata"]["name"]] = obj
    return out


@pytest.mark.parametrize("which", ["example", "other"])
def test_kubernetes_manifests_validate_offline_against_the_api_schemas(tmp_path, which) -> None:
    import kubernetes_validate

    plan = deploy.load_plan(EXAMPLE_PLAN) if which == "example" else a_plan(tmp_path)
    objects = _objects(plan)
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The schemas are really checked: a misspelt field and a wrong type are refused.
    broken = copy.deepcopy(objects["Deployment", "router"])
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(objects["Deployment", "router"])
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kubernetes_manifests_follow_the_plan(tmp_path) -> None:
    plan = a_plan(tmp_path)
    objects = _objects(plan)
    components = [f"expert-{g.name}" for g in plan.expert_groups] + ["router", "gateway"]
    for name in components:
        assert {("Deployment", name), ("Service", name), ("PodDisruptionBudget", name)} <= set(
            objects
        )
        assert objects["PodDisruptionBudget", name]["spec"]["maxUnavailable"] == 1
    for g in plan.expert_groups:
        d = objects["Deployment", f"expert-{g.name}"]
        assert d["spec"]["replicas"] == g.replicas
        pod = d["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
        [c] = pod["spec"]["containers"]
        assert _after(c["args"], "--experts") == g.experts
        assert _after(c["args"], "--advertise-host") == "$(POD_IP)"
        assert _after(c["args"], "--registry") == "kubernetes"  # the plan's default discovery
        assert c["readinessProbe"]["grpc"] == {"port": g.port}  # the gRPC health service
        size = {"cpu": f"{g.resources.cpu_mhz / 1000:g}", "memory": f"{g.resources.memory_mb}Mi"}
        assert c["resources"] == {"requests": size, "limits": size}
        env = {e["name"]: e for e in c["env"]}
        assert "CONSUL_HTTP_ADDR" not in env
        ns = env["MOE_MESH_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert ns == "metadata.namespace"
        assert objects["Service", f"expert-{g.name}"]["spec"]["clusterIP"] == "None"
        volume = pod["spec"]["volumes"][0]["persistentVolumeClaim"]
        assert volume == {"claimName": plan.kubernetes.model_volume.claim, "readOnly": True}
    gateway = objects["Service", "gateway"]["spec"]
    assert {p["name"]: p["port"] for p in gateway["ports"]} == {
        "grpc": plan.gateway.grpc_port,
        "http": plan.gateway.http_port,
        "metrics": 9400,
    }
    config = objects["ConfigMap", f"{plan.name}-prometheus"]["data"]["prometheus.yml"]
    [job] = yaml.safe_load(config)["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [plan.kubernetes.namespace]


# ------------------------------------------------------------------------------------- security


def _kind(component: str) -> str:
    return "expert" if component.startswith("expert-") else component


def _wanted(component: str) -> set[str]:
    """The secret files a component of the (secured) example plan reads."""
    tls = {"tls-ca.pem", "tls-cert.pem", "tls-key.pem"}
    return tls | ({"api-keys"} if component == "gateway" else set())


def _secret_flags(args: list[str], component: str, directory: str) -> set[str]:
    """The files the service's flags name, which must all be in `directory`."""
    flags = ["--tls-cert", "--tls-key", "--tls-ca"]
    flags += ["--api-key-file"] if component == "gateway" else []
    paths = [_after(args, f) for f in flags]
    assert all(p.startswith(directory + "/") for p in paths), paths
    assert _after(args, "--tls-server-name") == "moe-mesh"
    return {p.removeprefix(directory + "/") for p in paths}


def test_secured_compose_mounts_every_key_and_certificate_as_a_secret_file() -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    assert plan.security.tls and plan.security.api_keys
    doc = _compose(plan)
    assert _schema_errors(doc) == []
    declared = doc["secrets"]
    for name, s in doc["services"].items():
        if name in ("consul", "prometheus"):
            continue
        kind = _kind(name)
        mounted = {m["target"]: m["source"] for m in s["secrets"]}
        assert set(mounted) == _wanted(name) | {"consul-token"}
        assert mounted["tls-cert.pem"] == f"{kind}-tls-cert"
        assert mounted["tls-key.pem"] == f"{kind}-tls-key"
        assert _secret_flags(s["command"], name, "/run/secrets") <= set(mounted)
        # The health check presents the service's own certificate.
        assert _secret_flags(s["healthcheck"]["test"], "probe", "/run/secrets") <= set(mounted)
        env = s["environment"]
        assert "CONSUL_HTTP_TOKEN" not in env
        assert env["CONSUL_HTTP_TOKEN_FILE"] == "/run/secrets/consul-token"
        for source in mounted.values():  # each one a file `moe-mesh certs` (or the operator) writes
            assert declared[source]["file"].startswith("./secrets/")
    assert declared["expert-tls-key"] == {"file": "./secrets/expert-key.pem"}
    assert declared["tls-ca"] == {"file": "./secrets/ca.pem"}


def test_secured_kubernetes_pods_project_their_secrets_and_probe_a_plaintext_health_port() -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    objects = _objects(plan)
    for name in [f"expert-{g.name}" for g in plan.expert_groups] + ["router", "gateway"]:
        pod = objects["Deployment", name]["spec"]["template"]["spec"]
        [c] = pod["containers"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "secrets"]
        files = {
            item["path"]: source["secret"]["name"]
            for source in volume["projected"]["sources"]
            for item in source["secret"]["items"]
        }
        assert set(files) == _wanted(name)
        assert {files[f] for f in ("tls-ca.pem", "tls-cert.pem", "tls-key.pem")} == {
            f"moe-mesh-tls-{_kind(name)}"
        }
        if name == "gateway":
            assert files["api-keys"] == "moe-mesh-api-keys"
        assert volume["projected"]["defaultMode"] == 0o440 and pod["securityContext"] == {
            "fsGroup": 10001
        }
        [mount] = [m for m in c["volumeMounts"] if m["name"] == "secrets"]
        assert mount["readOnly"] and _secret_flags(c["args"], name, mount["mountPath"]) <= set(
            files
        )
        # The kubelet's gRPC probe has no TLS: it asks the health-only plaintext port.
        port = plan.kubernetes.health_port
        assert _after(c["args"], "--health-port") == str(port)
        assert c["readinessProbe"]["grpc"] == {"port": port}
        assert {"name": "health", "containerPort": port} in c["ports"]
        assert not any("BEGIN" in str(e.get("value", "")) for e in c["env"])


def test_secured_nomad_tasks_render_their_secrets_from_nomad_variables(tmp_path: Path) -> None:
    plan = deploy.load_plan(EXAMPLE_PLAN)
    for job_name, job in _jobs(plan).items():
        for group_name, group in _groups(job).items():
            [(task_name, task)] = [kv for t in group["task"] for kv in t.items()]
            component = "gateway" if group_name == "gateway" else "router"
            if group_name == "experts":
                component = "expert-x"
            written = {}
            for t in task["template"]:
                assert f'nomadVar "nomad/jobs/{job_name}"' in t["data"]
                assert (t["perms"], t["uid"], t["change_mode"]) == ("0400", 10001, "restart")
                written[t["destination"].removeprefix("secrets/")] = t["data"]
            assert set(written) == _wanted(component) | {"consul-token"}
            assert f".{_kind(component)}_tls_key " in written["tls-key.pem"]
            args = _one(task, "config")["args"]
            assert _secret_flags(args, component, "${NOMAD_SECRETS_DIR}") <= set(written)
            env = _one(task, "env")
            assert env["CONSUL_HTTP_TOKEN_FILE"] == "${NOMAD_SECRETS_DIR}/consul-token"
            [grpc] = [s for s in group["service"] if s["port"] == "grpc"]
            check = _one(grpc, "check")
            assert check["type"] == "script" and check["task"] == task_name
