"""The preStop hook marks the node draining with the internal token, then waits out the lease."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time


def test_drain_posts_with_the_internal_token_then_waits():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pdpool.operator.drain", "--port", str(server.server_port),
                    "--wait", "0.5"], check=True, env={"PDPOOL_INTERNAL_TOKEN": "tok", "PATH": "/usr/bin:/bin"})
    assert time.monotonic() - started >= 0.5
    assert seen == [("/admin/drain", "Bearer tok")]
    server.shutdown()
    server.server_close()
    # a node that is already gone: still waits, still exits 0
    assert subprocess.run([sys.executable, "-m", "pdpool.operator.drain", "--port", str(server.server_port),
                           "--wait", "0"], capture_output=True).returncode == 0
