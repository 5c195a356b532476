"""`moe-mesh up --tls` as a user runs it: certificates made for the mesh, mutual TLS on every hop
(gateway -> router -> expert services, registry health checks included), the fast path carrying
the expert calls behind authenticated hellos, the transformers tokens through the gateway, API
keys at the edge, and `status` / `generate` reading the client certificate from the ready file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai

from common.fastpath.ucx import load_ucxx
from common.tls import MeshTls, open_channel
from protos.moe_mesh.v1 import inference_pb2, inference_pb2_grpc
from tests.support import hf
from tests.support.cli import moe_mesh
from tests.support.reference import PROMPTS

KEY = "sk-up-tls-0123456789"


def test_up_tls_serves_transformers_tokens_and_refuses_strangers(checkpoint, tmp_path) -> None:
    path = checkpoint("mixtral")
    ready, keys = tmp_path / "mesh.json", tmp_path / "keys"
    keys.write_text(f"{KEY} name=test\n")
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "moe_mesh", "up", "--checkpoint", str(path)),
            *("--expert-services", "2", "--tls", "--api-key-file", str(keys)),
            *("--ready-file", str(ready), "--run-dir", "run"),  # relative: to the cwd below
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "mesh not up in 120 s"
            time.sleep(0.1)
        mesh = json.loads(ready.read_text())
        # The ready file names its files absolutely: client commands here run in another cwd.
        assert all(Path(f).is_absolute() for f in mesh["tls"].values()), mesh["tls"]
        client = MeshTls.load(*(Path(mesh["tls"][n]) for n in ("cert", "key", "ca")))
        ca = Path(mesh["tls"]["ca"])
        key = (("authorization", f"Bearer {KEY}"),)

        async def generate_all() -> tuple[tuple[int, ...], ...]:
            async with open_channel(mesh["gateway_grpc"], [], tls=MeshTls.ca_only(ca)) as ch:
                stub = inference_pb2_grpc.InferenceStub(ch)
                replies = [
                    await stub.Generate(
                        inference_pb2.GenerateRequest(
                            prompt_token_ids=p, max_tokens=32, temperature=0.0, ignore_eos=True
                        ),
                        metadata=key,
                        timeout=60,
                    )
                    for p in PROMPTS
                ]
            return tuple(tuple(r.token_ids) for r in replies)

        assert asyncio.run(generate_all()) == hf.greedy(path)

        async def strangers() -> list[grpc.StatusCode]:
            codes = []
            for address in [mesh["routers"][0], mesh["experts"][0]["address"]]:
                for tls in [None, MeshTls.ca_only(ca)]:  # plaintext; TLS without a certificate
                    async with open_channel(address, [], tls=tls) as ch:
                        try:
                            await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)
                        except grpc.aio.AioRpcError as e:
                            codes.append(e.code())
            async with open_channel(mesh["routers"][0], [], tls=client) as ch:
                await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)
            return codes

        assert asyncio.run(strangers()) == [grpc.StatusCode.UNAVAILABLE] * 4

        context = ssl.create_default_context(cafile=ca)
        with openai.OpenAI(
            base_url=f"https://{mesh['gateway_http']}/v1",
            api_key=KEY,
            max_retries=0,
            http_client=httpx.Client(verify=context),
        ) as oa:
            done = oa.completions.create(model="", prompt="hello", max_tokens=4)
            assert done.usage.completion_tokens >= 1

        status = moe_mesh("status", "--ready-file", ready, "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert all(
            s["health"] == "SERVING" for s in [st["gateway"], *st["routers"], *st["experts"]]
        )
        replicas = [r for r in st["routers"][0]["replicas"] if r["backend"] != "colocated"]
        if load_ucxx(loopback=True) is not None:  # authenticated hellos: no call fell back
            assert all(r["transport"] == "ucx" and not r["fast_path_fallbacks"] for r in replicas)
            assert sum(r["fast_path_calls"] for r in replicas) > 0

        env = {**os.environ, "MOE_MESH_API_KEY": KEY}
        generate = [sys.executable, "-m", "moe_mesh", "generate", "--ready-file", str(ready)]
        args = ["--prompt", "hi", "--max-tokens", "3", "--json"]
        ok = subprocess.run([*generate, *args], env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert len(json.loads(ok.stdout)["token_ids"]) >= 1
        env.pop("MOE_MESH_API_KEY")
        no = subprocess.run([*generate, *args], env=env, capture_output=True, text=True, timeout=60)
        assert no.returncode == 2 and "UNAUTHENTICATED" in no.stderr, no.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
        log.close()
