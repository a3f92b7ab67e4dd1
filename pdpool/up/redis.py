"""The pool's own ``redis-server`` (from PATH) on a free loopback port, and the checks on an external one.

Its password is generated and handed over in a config file readable by the owner only, never in argv; nothing is
persisted (block ownership is rebuilt by the nodes' heartbeats).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

INSTALL_HINT = ("redis-server was not found on PATH. pdpool up runs its own Redis; install it with\n"
                "    sudo apt-get install -y redis-server      # Debian, Ubuntu\n"
                "    brew install redis                        # macOS\n"
                "or name an external Redis in the pool (spec.redis.url, password in PDPOOL_REDIS_PASSWORD).")


class RedisMissing(RuntimeError):
    pass


class ManagedRedis:
    def __init__(self, run_dir: Path, port: int) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisMissing(INSTALL_HINT)
        self.run_dir = run_dir
        self.port = port
        self.password = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "ManagedRedis":
        conf = self.run_dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'port {self.port}\nbind 127.0.0.1\nrequirepass "{self.password}"\nsave ""\n'
                    f'appendonly no\ndaemonize no\nloglevel warning\ndir "{self.run_dir}"\n')
        self.proc = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ping(self.url, self.password):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{self.proc.stdout.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")
            time.sleep(0.05)
        return self

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            (self.run_dir / "redis.conf").unlink()


def ping(url: str, password: str | None) -> bool:
    import redis

    client = redis.Redis.from_url(url, password=password, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def live_node_ids(url: str, password: str | None, namespace: str, pool: str) -> list[str]:
    """Nodes heartbeating in this pool now (raises ``IndexUnavailableError`` when Redis cannot be read)."""
    from pdpool.kv_index.keys import PoolKeys
    from pdpool.kv_index.redis_index import IndexReader, connect

    client = connect(url, password, timeout=2.0)
    try:
        return sorted(IndexReader(client, PoolKeys(namespace, pool)).live_nodes())
    finally:
        client.close()


def count_pool_keys(url: str, password: str | None, namespace: str, pool: str) -> int:
    import redis

    from pdpool.kv_index.keys import PoolKeys

    client = redis.Redis.from_url(url, password=password, socket_timeout=2, socket_connect_timeout=2)
    try:
        return sum(1 for _ in client.scan_iter(match=PoolKeys(namespace, pool).scan_pattern, count=500))
    finally:
        client.close()
