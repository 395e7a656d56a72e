"""The serving pods' process in ``python -m benchmarks scheduling exp2``: a tiny HTTP server.

    python -m benchmarks.scheduling.serving_app ENDPOINTS_DIR NAME

Answers every ``GET`` with ``200 ok <NAME>`` on a free port of 127.0.0.1 (every pod of the test
cluster has that IP, so each takes its own port) and writes the port to ``ENDPOINTS_DIR/NAME``
once it listens: the traffic script's stand-in for a Service's endpoints. On SIGTERM (a
scale-down or a preemption) it removes that file first, so no new request comes, finishes the
requests in progress and exits 0. Standard library only: it starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def serve(endpoints: Path, name: str) -> int:
    body = f"ok {name}\n".encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # one line per request is noise
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    endpoint = endpoints / name
    endpoints.mkdir(parents=True, exist_ok=True)
    partial = endpoints / f".{name}.tmp"
    partial.write_text(str(server.server_address[1]))
    os.replace(partial, endpoint)  # readers never see a half-written port

    def stop(*_: object) -> None:
        endpoint.unlink(missing_ok=True)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"serving {name} on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(serve(Path(sys.argv[1]), sys.argv[2]))
