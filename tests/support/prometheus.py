"""A real Prometheus server for tests (Debian's `prometheus` binary; tests skip without it): started
on a free loopback port scraping the jobs given, asked PromQL, waited on."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_mesh.planning.deploy.prometheus import prometheus_yml
from tests.support.net import free_port

PROMETHEUS = shutil.which("prometheus")
MISSING = "no `prometheus` binary (Debian package prometheus)"


@contextmanager
def running(jobs: list[dict], work: Path) -> Iterator[str]:
    """Prometheus scraping `jobs` every second, its files under `work`: yields its base URL."""
    assert PROMETHEUS is not None, MISSING
    config = work / "prometheus.yml"
    config.write_text(prometheus_yml(jobs, interval="1s"))
    port = free_port()
    with open(work / "prometheus.log", "w") as log:
        server = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


def promql(base: str, query: str) -> float | None:
    """The first sample of an instant query, None when it has none."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def until(what: str, check, timeout_s: float = 60.0):
    """check()'s first true value, polled for at most timeout_s (Prometheus may not listen yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout_s:g}s")
