"""The server before its app is up: every request on the bound port answered 503 with what the start-up is doing.

While the weights resolve, hash, load and derive (minutes with the real ones), a load balancer or liveness probe
must see "not ready", not a hung socket. `answering_while_starting(sock, ...)` serves the listening socket from a
thread of plain HTTP/1.0 answers — `GET /health`: 503 with the Health fields (`status: unavailable`, the engine
`starting`) and a `startup` object (`startup.STARTUP.snapshot()`: the phase, each step's seconds and bytes done
of its total); any other path: 503 with the error body the app uses — every answer with `Retry-After: 5` and
`Connection: close`. When the block ends, the thread has stopped taking connections and uvicorn takes over the
same socket: connections that arrive meanwhile wait in its backlog, so no client sees a refusal.
"""
from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from typing import Iterator

from ..startup import STARTUP, StartupRecord

RETRY_AFTER_S = 5
REQUEST_TIMEOUT_S = 5.0  # a client that sends no request line within this is dropped


def startup_health(record: StartupRecord, backend: str) -> dict:
    """/health's document while starting: Health's fields, with the start-up's steps."""
    snapshot = record.snapshot()
    running = [step for step in snapshot["steps"] if not step.get("finished")]
    doing = "; ".join(f"{step['phase']} {step['what']}" + (f" ({step['done_bytes']} of {step['total_bytes']} bytes)"
                                                           if step.get("total_bytes") else "")
                      for step in running) or "starting"
    return {"status": "unavailable", "problems": [f"the server is starting: {doing}"],
            "engine": {"backend_requested": backend, "state": "starting"}, "queue": {"depth": 0}, "in_flight": 0,
            "startup": snapshot}


def _handler(record: StartupRecord, backend: str):
    class Starting(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one answer per connection
        timeout = REQUEST_TIMEOUT_S

        def _answer(self, body: bytes | None) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                document = startup_health(record, backend)
            else:
                phase = record.snapshot()["phase"]
                document = {"error": {"status": 503, "message": f"the server is starting ({phase}); retry later "
                                                               "(GET /health says how far it is)", "field": None}}
            data = json.dumps(document).encode("utf-8")
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Retry-After", str(RETRY_AFTER_S))
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            if body is None:
                self.wfile.write(data)

        def do_GET(self):
            self._answer(None)

        def do_HEAD(self):
            self._answer(b"")

        do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

        def version_string(self) -> str:  # no server header beyond the protocol's minimum
            return "yue2-vllm"

        def log_message(self, format, *args) -> None:  # quiet: probes may ask every second
            pass

    return Starting


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    block_on_close = False


@contextlib.contextmanager
def answering_while_starting(sock: socket.socket, backend: str, record: StartupRecord = STARTUP) -> Iterator[None]:
    """Answer 503 on `sock` (listening already) until the block ends; the socket stays open for the app."""
    server = _Server(sock.getsockname()[:2], _handler(record, backend), bind_and_activate=False)
    server.socket.close()  # the one TCPServer made: the bound socket is served instead
    server.socket = sock
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="yue2-serve-starting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()  # returns once serve_forever has stopped accepting
        thread.join(timeout=5)
