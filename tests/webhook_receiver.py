"""A real HTTP receiver on loopback for webhook tests: it records every POST and answers
with the statuses a test scripts for each path (200 once the script is used up)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# --- the receiver ------------------------------------------------------------------------


@dataclass
class Received:
    at: float
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers POST /{path} with the next scripted (status, headers, delay); 200 after."""

    port: int
    scripts: dict[str, list[tuple[int, dict[str, str], float]]] = field(default_factory=dict)
    received: dict[str, list[Received]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, path: str, *steps: int | tuple[int, dict[str, str], float]) -> str:
        self.scripts[path] = [s if isinstance(s, tuple) else (s, {}, 0.0) for s in steps]
        return self.url(path)

    def requests(self, path: str) -> list[Received]:
        with self.lock:
            return list(self.received.get(path, []))


def handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with receiver.lock:
                receiver.received.setdefault(self.path, []).append(
                    Received(time.time(), dict(self.headers.items()), body)
                )
                steps = receiver.scripts.get(self.path) or [(200, {}, 0.0)]
                status, headers, delay = steps.pop(0) if len(steps) > 1 else steps[0]
            time.sleep(delay)
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()
            except OSError:
                pass  # the sender timed out and went away

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def serve_receiver() -> tuple[Receiver, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    state = Receiver(server.server_address[1])
    server.RequestHandlerClass = handler(state)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return state, server
