"""When :class:`TritonServer` calls a server ready, and the ports it picks
(triton_rec/triton/server.py).

tritonserver opens gRPC, then HTTP, then its metrics port (``StartEndpoints`` in its
src/main.cc), so ``/v2/health/ready`` answers 200 a moment before the metrics port
listens; a caller that scrapes metrics right after ``start()`` was refused a connection
(once in CI). Here a real HTTP endpoint answers ready while the metrics port is closed,
then open: ready only once it listens, or at once for a server that opens no metrics port.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from triton_rec.triton.server import TritonServer, free_port, free_ports


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def http_port():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def _server(tmp_path, http_port, extra=()):
    return TritonServer(
        tmp_path, http_port=http_port, metrics_port=free_port(), extra_args=list(extra)
    )


def test_ready_waits_for_the_metrics_port(tmp_path, http_port):
    server = _server(tmp_path, http_port)
    assert not server.is_ready()  # HTTP says ready, the metrics port is not open yet
    with socket.create_server(("127.0.0.1", server.metrics_port)):
        assert server.is_ready()
    assert not server.is_ready()


def test_a_server_without_metrics_is_ready_when_http_is(tmp_path, http_port):
    server = _server(tmp_path, http_port, ["--allow-metrics=false"])
    assert not server.metrics_enabled()
    assert server.is_ready()
    # the last flag wins, as on tritonserver's command line
    again = _server(tmp_path, http_port, ["--allow-metrics=false", "--allow-metrics=true"])
    assert again.metrics_enabled()
    assert not again.is_ready()


def test_no_http_answer_is_not_ready_whatever_the_metrics_port(tmp_path):
    server = _server(tmp_path, free_port())
    with socket.create_server(("127.0.0.1", server.metrics_port)):
        assert not server.is_ready()


def test_a_servers_ports_are_distinct(tmp_path):
    # picked one at a time, two of them were once the same port, and tritonserver refused
    # to start ("cannot listen to HTTP requests and metrics requests at the same address
    # and port"): they are picked while each is held
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert ports[0] not in free_ports(8, taken=ports[:1])
    for _ in range(20):
        s = TritonServer(tmp_path, grpc_port=ports[0])
        assert len({s.http_port, s.grpc_port, s.metrics_port}) == 3 and s.grpc_port == ports[0]
