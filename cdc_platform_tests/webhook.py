"""A real HTTP server on loopback that records JSON POSTs: the alert webhook in tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Webhook URLs carry secrets in their path and query; tests check neither leaks.
SECRET_PATH = "/services/T0001/B0002/SeCrEtToKeN123456"
SECRET_QUERY = "token=qs-secret-987"


@dataclass
class Captured:
    path: str
    content_type: str
    body: dict
    raw: bytes


@dataclass
class Webhook:
    """A loopback HTTP server recording what is POSTed and answering with `status`."""

    port: int
    posted: list[Captured] = field(default_factory=list)
    status: int = 200
    answer: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def secret_url(self) -> str:
        return f"{self.base}{SECRET_PATH}?{SECRET_QUERY}"


@contextmanager
def serve_webhook() -> Iterator[Webhook]:
    """Run a loopback webhook server for the duration of the block."""
    state: dict[str, Webhook] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hook = state["hook"]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            hook.posted.append(
                Captured(self.path, self.headers.get("Content-Type", ""), json.loads(raw), raw)
            )
            self.send_response(hook.status)
            for name, value in hook.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(hook.answer)))
            self.end_headers()
            self.wfile.write(hook.answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["hook"] = Webhook(port=server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["hook"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
