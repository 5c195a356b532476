"""A service's Prometheus samples, flattened, and sums over label filters, against a real endpoint."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import UnavailableError
from moe_mesh.benchmark.metrics import samples, total

TEXT = b"""# TYPE moe_calls counter
moe_calls_total{otel_scope_name="x",transport="grpc",layer="1"} 3
moe_calls_total{otel_scope_name="x",transport="ucx",layer="1"} 4
moe_calls_total{otel_scope_name="x",transport="grpc",layer="2"} 5
# TYPE moe_depth gauge
moe_depth 2
"""


@pytest.fixture
def endpoint():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(TEXT)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_samples_are_keyed_by_name_and_sorted_labels_without_otel_scope(endpoint) -> None:
    got = samples(endpoint)
    assert got == {
        "moe_calls_total{layer=1,transport=grpc}": 3.0,
        "moe_calls_total{layer=1,transport=ucx}": 4.0,
        "moe_calls_total{layer=2,transport=grpc}": 5.0,
        "moe_depth{}": 2.0,
    }
    assert total(got, "moe_calls_total") == 12
    assert total(got, "moe_calls_total", transport="grpc") == 8
    assert total(got, "moe_calls_total", transport="grpc", layer="2") == 5
    assert total(got, "moe_calls") == 0  # a family's sample name, not a prefix of it


def test_nothing_listening_is_unavailable() -> None:
    with pytest.raises(UnavailableError, match="127.0.0.1:9"):
        samples("127.0.0.1:9")
