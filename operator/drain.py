"""preStop hook of a node: mark it draining, then outlive the KV leases it granted.

Runs inside the node's container as ``python -m pdpool.operator.drain --port 8000 --wait 30``.
``POST /internal/drain`` (with the internal token, ``PDPOOL_INTERNAL_TOKEN``) turns ``/health/ready`` false, so the Service and the
router stop sending work, while leases already granted are honoured until they expire.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request

from pdpool import internal_api


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdpool.operator.drain")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait after draining (the KV lease)")
    args = parser.parse_args(argv)
    request = urllib.request.Request(internal_api.url("127.0.0.1", args.port, "drain"), method="POST", data=b"",
                                     headers=internal_api.headers(os.environ.get("PDPOOL_INTERNAL_TOKEN")))
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except (urllib.error.URLError, OSError) as exc:  # the node may already be gone; still wait out the leases
        print(f"drain: {exc}", file=sys.stderr)
    time.sleep(args.wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
