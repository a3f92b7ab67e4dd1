"""``pdpool up``: run a pool (Redis, prefill and decode nodes, the router) on this machine until Ctrl-C or SIGTERM.

    pdpool up [POOL.yaml] [--port 8000] [--host 127.0.0.1] [--dry-run] [-- SERVE_FLAGS...]

Order of events: read and check the pool; start Redis (unless the pool names one); start every node and the
router, each output line prefixed with its name; show each process's state until the router sees every node;
print how to call the pool; supervise (restarts with backoff). On SIGINT/SIGTERM: the router stops first (what it
has in flight finishes), then the nodes (they drain, release their leases and deregister), then the pool's Redis
keys that are left (a killed node's) are deleted, then Redis. A second signal kills everything at once (exit code
128 + that signal; a clean stop exits 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import importlib.util
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from pdpool.models.demo import check_model
from pdpool.node_process import free_port, http_get, parse_metrics
from pdpool.up import redis as local_redis
from pdpool.up import state
from pdpool.up.pool import (FlagError, FlagParser, PoolFileError, connect_host, load_pool, local_router_config, plan,
                            refused_extra_flag, replicas, shared_env)
from pdpool.up.supervisor import Child, Output
from pdpool.utils import http_url

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py (the nodes', the router's client) takes
ROUTER_STOP_GRACE = 30.0
PROGRESS_EVERY = 15.0
TICK = 0.5
SIGNAL_DEBOUNCE = 1.0  # seconds: a second signal within it is the first one again


def tcp_port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(
        prog="pdpool up", description="Run an InferencePool (nodes, router, Redis) as local processes.",
        epilog="Flags after -- go to every node's `pdpool serve` (e.g. -- --num-kv-blocks 256), and those the router "
               "shares (--model, --served-model-name, --dtype, --block-size, ...) to the router too.")
    parser.add_argument("pool", nargs="?", help="InferencePool YAML, as the operator takes it (default: the "
                        "built-in example: the demo model, 1 prefill + 1 decode node on CPU)")
    parser.add_argument("--port", type=tcp_port, help="the router's port (default: the pool's router.port, 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's address (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the processes it would start, and exit")
    args = parser.parse_args(argv)
    args.serve_flags = extra
    return args


class Up:
    def __init__(self, args: argparse.Namespace, out: Output) -> None:
        self.args = args
        self.out = out
        self.pool, self.ignored = load_pool(args.pool)
        refused = refused_extra_flag(args.serve_flags)
        if refused is not None:
            raise PoolFileError(refused)
        self.router_cfg = local_router_config(self.pool, args.serve_flags)  # the pool's, as the nodes' flags make it
        self.port = args.port or self.pool.router.router.port
        self.state_path = state.state_path(self.port)
        self.redis: local_redis.ManagedRedis | None = None
        self.redis_url = self.pool.spec["redis"].get("url")
        if self.redis_url is not None and not self.redis_url.startswith(REDIS_SCHEMES):
            raise PoolFileError(f"{args.pool}: spec.redis.url {self.redis_url!r} must start with "
                                f"{', '.join(REDIS_SCHEMES)}")
        self.redis_password = None if self.pool.managed_redis else os.environ.get("PDPOOL_REDIS_PASSWORD")
        self.children: list[Child] = []
        self.run_dir: str | None = None
        self.stop_signals = 0
        self.first_signal = 0.0
        self.killed_by: int | None = None  # the second signal, which killed every process without a clean stop
        self.ready = False
        self.router_url = http_url(connect_host(args.host), self.port)

    def say(self, text: str) -> None:
        self.out.line("up", text)

    # ---- start --------------------------------------------------------------------------------------------

    def specs(self, redis_url: str):
        return plan(self.pool, redis_url=redis_url, router_host=self.args.host, router_port=self.port,
                    node_port=free_port, extra_node_flags=self.args.serve_flags)

    def dry_run(self) -> int:
        for spec in self.specs(self.redis_url or "redis://127.0.0.1:<free port>/0"):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items()))
            self.say(f"{spec.name}: {env + ' ' if env else ''}pdpool {shlex.join(spec.argv)}")
        return 0

    def start_redis(self) -> None:
        p = self.pool
        if p.managed_redis:
            self.run_dir = tempfile.mkdtemp(prefix=f"run-{self.port}-", dir=self._state_dir())
            self.redis = local_redis.ManagedRedis(Path(self.run_dir), free_port()).start()
            self.out.pump("redis", self.redis.proc.stdout)
            self.redis_url, self.redis_password = self.redis.url, self.redis.password
            self.say(f"redis-server (pid {self.redis.proc.pid}) on {self.redis.url}")
            return
        if not local_redis.ping(self.redis_url, self.redis_password):
            raise RuntimeError(f"cannot reach the pool's Redis at {self.redis_url} (password from "
                               "PDPOOL_REDIS_PASSWORD)")
        live = local_redis.live_node_ids(self.redis_url, self.redis_password, p.namespace, p.name)
        if live:
            raise RuntimeError(f"pool {p.namespace}/{p.name} already has live nodes in {self.redis_url}: "
                               f"{', '.join(live)}; stop them or give this pool another metadata.name")
        self.say(f"using the pool's Redis at {self.redis_url}")

    def restart_redis(self) -> None:
        """Same port and password; the nodes notice an empty Redis at their next heartbeat and republish."""
        self.say(f"redis-server exited with code {self.redis.proc.returncode}; restarting it")
        self.redis.start()
        self.out.pump("redis", self.redis.proc.stdout)
        self.say(f"redis-server (pid {self.redis.proc.pid}) on {self.redis.url}")

    def _state_dir(self) -> str:
        d = state.state_dir()
        d.mkdir(parents=True, exist_ok=True)
        return str(d)

    def start(self) -> None:
        p = self.pool
        for pid, stopped in state.reap_stale():
            self.say(f"stopped {len(stopped)} processes left running by a killed pdpool up (pid {pid}): "
                     f"{', '.join(map(str, stopped)) or 'none'}")
        self.say(f"pool {p.name}: model {self.router_cfg.served_model_name}, {replicas(p, 'prefill')} prefill + "
                 f"{replicas(p, 'decode')} decode on {p.node.device.device}, router on port {self.port}")
        self.start_redis()
        env = dict(os.environ, **shared_env(p, self.redis_password, secrets.token_urlsafe(32)))
        for spec in self.specs(self.redis_url):
            child = Child(spec, dict(env, **spec.env), self.out)
            self.children.append(child)
            child.start()
            self.say(f"{spec.name}: pid {child.pid}, {spec.url}")
        if p.node.model.model == "demo":
            self.say("the first start converts the demo model once; the nodes then load it")
        self.write_state()

    # ---- supervise ----------------------------------------------------------------------------------------

    def router_sees_every_node(self) -> bool:
        try:
            status, body = http_get(f"{self.router_url}/metrics", timeout=2)
        except OSError:
            return False
        if status != 200:
            return False
        m = parse_metrics(body.decode())
        return all(m.get(f'pdpool_router_nodes{{role="{role}",usable="true"}}', 0) >= replicas(self.pool, role)
                   for role in ("prefill", "decode"))

    def progress(self, started: float) -> None:
        states = " · ".join(f"{c.name} {c.state}" for c in self.children)
        self.say(f"{states}   ({time.monotonic() - started:.0f}s)")

    def supervise(self) -> None:
        started = last_progress = time.monotonic()
        self.progress(started)
        while not self.stop_signals:
            now = time.monotonic()
            changed = [c.poll(now) for c in self.children]
            if self.redis is not None and self.redis.proc.poll() is not None:
                self.restart_redis()
                changed.append(True)
            if any(changed) or (not self.ready and now - last_progress >= PROGRESS_EVERY):
                self.progress(started)
                last_progress = now
                self.write_state()
            if not self.ready and all(c.state == "ready" for c in self.children) and self.router_sees_every_node():
                self.ready = True
                self.write_state()
                self.banner(time.monotonic() - started)
            time.sleep(TICK)

    def banner(self, seconds: float) -> None:
        base = f"{self.router_url}/v1"
        model = self.router_cfg.served_model_name
        keyed = bool(os.environ.get("PDPOOL_API_KEY"))
        auth = ' -H "Authorization: Bearer $PDPOOL_API_KEY"' if keyed else ""
        key = "os.environ['PDPOOL_API_KEY']" if keyed else "'unused'"
        body = f'{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}}'
        py = (f"from openai import OpenAI; import os; c = OpenAI(base_url='{base}', api_key={key}); "
              f"print(c.completions.create(model='{model}', prompt='The capital of France is', max_tokens=16, "
              "temperature=0).choices[0].text)")
        self.say(f"pool {self.pool.name} is ready in {seconds:.0f}s: {base}")
        self.say(f"  curl -s {base}/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
        self.say(f'  python -c "{py}"   # pip install openai')
        self.say("  pdpool status        # nodes, load and the router's decisions; Ctrl-C stops the pool")

    # ---- stop ---------------------------------------------------------------------------------------------

    def on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.stop_signals and now - self.first_signal < SIGNAL_DEBOUNCE:
            return  # the same Ctrl-C, forwarded by a wrapper (make, timeout) or sent to the whole group
        self.stop_signals += 1
        self.first_signal = self.first_signal or now
        if self.stop_signals > 1:  # only signals here: the main thread may be inside a wait()
            self.killed_by = signum
            self.say("second signal: killing every process now")
            for child in self.children:
                child.kill_now()
            if self.redis is not None and self.redis.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.redis.proc.kill()

    def stop(self) -> int:
        self.say("stopping: the router, then the nodes (they drain and deregister), then Redis")
        routers = [c for c in self.children if c.spec.role == "router"]
        nodes = [c for c in self.children if c.spec.role != "router"]
        for group, grace in ((routers, ROUTER_STOP_GRACE), (nodes, float(self.pool.termination_grace_seconds))):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + grace
            for child in group:
                child.wait_stopped(deadline)
            self.write_state()
        code = 0
        started = bool(self.children)  # nothing ran (an unreachable Redis, say): nothing to clean up after
        if started and self.redis_url is not None and (self.redis is None or self.redis.proc.poll() is None):
            code = self.clean_redis()
        if self.redis is not None:
            self.redis.stop()
            self.say("redis-server stopped")
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        state.remove(self.state_path)
        self.say("stopped")
        return code

    def clean_redis(self) -> int:
        from pdpool.kv_index.cleanup import delete_pool_keys

        p = self.pool
        try:
            left = local_redis.count_pool_keys(self.redis_url, self.redis_password, p.namespace, p.name)
            if left:
                deleted = asyncio.run(delete_pool_keys(self.redis_url, self.redis_password, p.namespace, p.name))
                self.say(f"deleted {deleted} pool keys left in Redis")
            else:
                self.say("no pool keys left in Redis")
        except Exception as exc:  # noqa: BLE001 (a Redis error must not keep Redis and the rest running)
            self.say(f"could not clean the pool's Redis keys: {exc}")
            return 1
        return 0

    def write_state(self) -> None:
        p = self.pool
        state.write(self.state_path, {
            "pid": os.getpid(), "pool": p.name, "namespace": p.namespace, "model": self.router_cfg.served_model_name,
            "router_url": self.router_url, "ready": self.ready,
            "redis_url": self.redis_url, "redis_password": self.redis_password,
            "redis_pid": self.redis.proc.pid if self.redis is not None else None, "run_dir": self.run_dir,
            "processes": [{"name": c.name, "role": c.spec.role, "url": c.spec.url, "pid": c.pid, "state": c.state,
                           "restarts": c.restarts} for c in self.children],
        })


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    out = Output()
    try:
        up = Up(args, out)
    except (PoolFileError, OSError) as exc:
        print(f"pdpool up: error: {exc}", file=sys.stderr)
        return 2
    if up.ignored:
        up.say(f"ignoring Kubernetes-only fields: {', '.join(up.ignored)}")
    if args.dry_run:
        return up.dry_run()
    flags_error = check_serve_flags(up.specs(up.redis_url or "redis://127.0.0.1:6379/0"))
    if flags_error is not None:  # each node would exit on it and be restarted, with backoff, forever
        print(f"pdpool up: error: {flags_error}", file=sys.stderr)
        return 2
    try:   # every node and the router would fail on it and restart, with backoff, forever
        check_model(up.router_cfg.router.model, "model.name")
    except FileNotFoundError as exc:
        print(f"pdpool up: error: {exc}", file=sys.stderr)
        return 2
    bind_error = port_taken(args.host, up.port)
    if bind_error is not None:
        print(f"pdpool up: error: {bind_error}", file=sys.stderr)
        return 2
    if not nixl_installed():
        print(f"pdpool up: error: {NIXL_HINT}", file=sys.stderr)
        return 1
    if up.pool.managed_redis and not shutil.which("redis-server"):
        print(f"pdpool up: error: {local_redis.INSTALL_HINT}", file=sys.stderr)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, up.on_signal)
    code = 0
    try:
        up.start()
        up.supervise()
    except (RuntimeError, OSError) as exc:
        out.line("up", f"error: {exc}")
        code = 1
    finally:
        stopped = up.stop()
    if up.killed_by is not None:  # requests in flight were cut and nodes did not deregister: not a clean stop
        return 128 + up.killed_by
    return code or stopped


NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")  # the ones pdpool.kv_transfer.agent imports
NIXL_HINT = ("the pool's prefill and decode nodes move the KV cache with NIXL, which is not installed here:\n"
             "    pip install 'pdpool[nixl]'      # nixl-cu12 (CPU and CUDA 12); nixl-cu13 on CUDA 13")


def nixl_installed() -> bool:
    """Checked before anything starts: without NIXL every node would fail to start, and restart, forever."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_PACKAGES)


def check_serve_flags(specs) -> str | None:
    """What ``pdpool serve`` would refuse in a node's flags (the pool's own and those after --), before any
    node starts."""
    from pdpool import config
    from pdpool.frontend import load_chat_template

    for spec in specs:
        if spec.argv[:1] != ["serve"]:
            continue
        parser = FlagParser(prog="pdpool serve")
        config.add_arguments(parser)
        try:
            cfg = config.from_args(parser.parse_args(spec.argv[1:]))
            if cfg.model.chat_template:   # pdpool serve refuses one it cannot read or compile (exit 2)
                load_chat_template(cfg.model.chat_template)
            if cfg.device.device == "cuda":   # the engine fails to load and exits 1, on every restart
                no_gpu = missing_cuda()
                if no_gpu is not None:
                    return (f"{spec.name} runs on cuda (engine.device, or --device after --), but {no_gpu}; "
                            "run the pool with engine.device: cpu")
            if cfg.device.attention_backend != "auto":   # one the device cannot run: the node exits 1 at load
                import torch

                from pdpool.attention.backend import check_device
                check_device(cfg.device.attention_backend, torch.device(cfg.device.device))
        except (FlagError, config.ConfigError, ValueError, OSError, ImportError) as exc:
            return f"{spec.name}'s pdpool serve flags (the pool's, and those after --): {exc}"
    return None


def missing_cuda() -> str | None:
    """Why this machine cannot run a CUDA node (None: it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "torch finds no CUDA device here"


def port_taken(host: str, port: int) -> str | None:
    """Why the router could not listen on ``host:port`` (None: it can)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host}: {exc.strerror}"
    family, _, _, _, address = infos[0]
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is in use (another pool? see pdpool status); give --port"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None
