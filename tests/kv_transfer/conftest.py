from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests/ folder
os.environ.setdefault("OMP_NUM_THREADS", "1")
from redis_server import RedisServer, redis_server  # noqa: E402,F401
