"""``pdpool up`` and ``pdpool status`` as a user runs them: real processes, real redis-server, real NIXL, the demo model.

The pool under test is the built-in example (``DEFAULT_POOL``: demo model, CPU, prefill and decode nodes) with small
test settings in its YAML, a Kubernetes-only field (which ``up`` must name and ignore), two decode replicas (so
requests keep succeeding while one restarts) and an external Redis (so the test can check that no pool key is
left after ``up`` stops). Tests run in file order; the last one stops the pool.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pdpool.kv_index.keys import PoolKeys
from pdpool.node_process import free_port, parse_metrics
from pdpool.up.pool import DEFAULT_POOL, PoolFileError, load_pool, router_spec
from redis_server import TEST_PASSWORD as REDIS_PASSWORD

pytestmark = pytest.mark.timeout(300)

POOL = "uptest"
PROMPT = ("The history of the city begins with a small fishing village on the river, where traders from the north "
          "met farmers from the valley every spring to exchange wool, salt and stories.")
CHAT = [{"role": "user", "content": "Name three colors."}]
LINE = re.compile(r"^[a-z0-9-]+ *\| ")


def pool_yaml(redis_url: str) -> dict:
    body = copy.deepcopy(DEFAULT_POOL)
    body["metadata"]["name"] = POOL
    spec = body["spec"]
    spec["engine"].update(maxModelLen=512, maxNumSeqs=4, maxNumBatchedTokens=256)
    spec["decode"]["replicas"] = 2
    spec["prefill"]["resources"] = {"limits": {"memory": "4Gi"}}  # Kubernetes-only: named once, ignored
    spec["redis"] = {"url": redis_url}
    return body


class UpProcess:
    """``pdpool up`` in the background; its output collected line by line."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", "up", *argv], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait_for_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))

    def log(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture(scope="module")
def up(demo_model_dir, pdpool_cache, tmp_path_factory, redis_module):
    path = tmp_path_factory.mktemp("up") / "pool.yaml"
    path.write_text(yaml.safe_dump(pool_yaml(redis_module.url)))
    port = free_port()
    env = dict(os.environ, PDPOOL_CACHE=str(pdpool_cache), PDPOOL_REDIS_PASSWORD=REDIS_PASSWORD)
    env.pop("PDPOOL_API_KEY", None)
    # float32: the tests compare the router's (disaggregated, prefix-cached) answers token for token with a
    # node's own. In bfloat16, the default on CPUs with native bf16, a prefix hit alone moves a near-tie's logits
    # (the tail's GEMMs have other shapes: measured -1.724/-1.724 cold, -1.687/-1.749 with 32 tokens cached).
    proc = UpProcess([str(path), "--port", str(port), "--", "--num-kv-blocks", "64", "--heartbeat-seconds", "0.5",
                      "--dtype", "float32"], env)
    proc.port, proc.env = port, env
    proc.state_path = Path(pdpool_cache) / "up" / f"{port}.json"
    try:
        proc.wait_for_line(r"^up +\| pool uptest is ready", timeout=240)
        yield proc
    finally:
        if proc.proc.poll() is None:  # a failed test left it running: stop it, then make sure
            proc.proc.send_signal(signal.SIGTERM)
            try:
                proc.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.proc.pid, signal.SIGKILL)


def state(up) -> dict:
    return json.loads(up.state_path.read_text())


def processes(up) -> dict[str, dict]:
    return {p["name"]: p for p in state(up)["processes"]}


def router_metrics(up) -> dict[str, float]:
    return parse_metrics(httpx.get(f"http://127.0.0.1:{up.port}/metrics", timeout=10).text)


def decisions(up, decision: str) -> float:
    return router_metrics(up).get(f'pdpool_router_requests_total{{decision="{decision}"}}', 0.0)


def client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# ---- without processes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine, message", [
    ({"maxNumSeq": 8}, "spec.engine.maxNumSeq: unknown field"),
    ({"maxNumSeqs": "8"}, "spec.engine.maxNumSeqs: expected integer"),
    ({"maxNumSeqs": 0}, "spec.engine.maxNumSeqs: 0 is below the minimum 1"),
    ({"device": "tpu"}, "spec.engine.device: 'tpu' is not one of"),
])
def test_the_operators_schema_checks_the_file(tmp_path, engine, message):
    body = copy.deepcopy(DEFAULT_POOL)
    body["spec"]["engine"].update(engine)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(PoolFileError, match=re.escape(message)):
        load_pool(tmp_path / "p.yaml")


SECRET_DOC = "apiVersion: v1\nkind: Secret\nmetadata: {name: api-key}\nstringData: {key: sk-123}\n"


@pytest.mark.parametrize("layout", ["---\n{pool}", "{pool}---\n", "{secret}---\n{pool}", "{pool}---\n{secret}---\n"])
def test_a_kubectl_file_of_several_documents_runs_its_one_pool(tmp_path, layout):
    """A file that `kubectl apply -f` takes: a leading or trailing '---', or the pool beside its Secret. Each was
    refused as 'not valid YAML ... but found another document'; the pool runs, and the other objects are named on
    the line of ignored fields."""
    pool = yaml.safe_dump(DEFAULT_POOL)
    (tmp_path / "p.yaml").write_text(layout.format(pool=pool, secret=SECRET_DOC))
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--dry-run",
                          "--port", "8123"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line.split("| ", 1)[1].split(":", 1)[0] for line in out.stdout.splitlines() if " pdpool " in line] == [
        "prefill-0", "decode-0", "router-0"]
    ignored = [line for line in out.stdout.splitlines() if "ignoring" in line]
    assert ignored == (["up        | ignoring Kubernetes-only fields: Secret/api-key"] if "{secret}" in layout else [])


@pytest.mark.parametrize("docs, message", [
    (["{pool}", "{pool}"], "2 InferencePools (demo, demo); give a file with one"),
    (["{secret}", "{secret}"], "no InferencePool (Secret/api-key, Secret/api-key)"),
    (["", ""], "no InferencePool"),
])
def test_a_file_without_exactly_one_pool_is_one_line_of_error(tmp_path, docs, message):
    pool = yaml.safe_dump(DEFAULT_POOL)
    (tmp_path / "p.yaml").write_text("---\n".join(d.format(pool=pool, secret=SECRET_DOC) for d in docs))
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == f"pdpool up: error: {tmp_path / 'p.yaml'}: {message}\n"


@pytest.mark.parametrize("text, message", [
    ("apiVersion: pdpool.io/v1alpha1\nkind: [InferencePool\n", "not valid YAML (line 3, column 1)"),
    ("apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: demo\n", "metadata: expected object"),
    ("apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: {name: Demo_1}\nspec: {}\n",
     "metadata.name 'Demo_1' must be a DNS-1035 label"),
    (f"apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: {{name: {'a' * 56}}}\nspec: {{}}\n",
     "of at most 55 characters"),
    # the CRD requires spec: a null or missing one was run as an empty pool
    ("apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: {name: demo}\nspec: null\n", "spec is required"),
    ("apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: {name: demo}\n", "spec is required"),
    ("apiVersion: pdpool.io/v1alpha1\nkind: InferencePool\nmetadata: {name: demo}\nspec: []\n", "spec: expected object"),
])
def test_a_malformed_file_is_one_line_of_error(tmp_path, text, message):
    """What the user wrote wrong, on one line, exit 2: no traceback (a YAML syntax error and a non-mapping metadata
    raised one), and no pool under a name the CRD refuses (the API server would refuse that file)."""
    (tmp_path / "p.yaml").write_text(text)
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith(f"pdpool up: error: {tmp_path / 'p.yaml'}: ") and message in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def external_redis_pool(tmp_path: Path, url: str) -> Path:
    body = copy.deepcopy(DEFAULT_POOL)
    body["spec"]["redis"] = {"url": url}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    return tmp_path / "p.yaml"


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "argument --port: '99999' is not a TCP port (1 to 65535)"),
    (["--port", "0"], "argument --port: '0' is not a TCP port"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:"),  # TEST-NET-1: an address of no interface here
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: "),
    (["pool:notaurl"], "spec.redis.url 'notaurl' must start with redis://, rediss://, unix://"),
    # a node refuses these at its start: each node exited and was restarted, with backoff, forever
    (["--", "--no-such-flag"], "prefill-0's pdpool serve flags (the pool's, and those after --): unrecognized "
                               "arguments: --no-such-flag"),
    (["--", "--max-num-seqs", "0"], "--max-num-seqs: 0 is below the minimum 1"),
    (["--", "--chat-template", "/no/such/template.jinja"], "--chat-template '/no/such/template.jinja' looks like a "
                                                           "file path, but it cannot be read"),
])
def test_bad_flags_and_addresses_are_one_line_of_error(tmp_path, args, message):
    """Refused before anything starts, on one line, exit 2 (--port 99999 and a Redis URL without a scheme raised a
    traceback; an address this machine does not have was called 'port in use'; bad node flags were found by each
    node, which exited and was restarted forever)."""
    args = [str(external_redis_pool(tmp_path, a.split(":", 1)[1])) if a.startswith("pool:") else a for a in args]
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", *args], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 2 and message in out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "in use" not in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine can run a CUDA node")
@pytest.mark.parametrize("where", ["file", "flags"])
def test_a_cuda_pool_without_a_gpu_is_refused_before_anything_starts(tmp_path, where):
    """A pool with engine.device: cuda (examples/gpu-1p1d.yaml with the demo model, say) on a machine without CUDA:
    every node failed to load ('Torch not compiled with CUDA enabled'), exited 1 and was restarted, with backoff,
    forever (seen by hand; not run here on the old code, where it would not end)."""
    body = copy.deepcopy(DEFAULT_POOL)
    if where == "file":
        body["spec"]["engine"]["device"] = "cuda"
        for role in ("prefill", "decode"):
            body["spec"][role]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    flags = ["--", "--device", "cuda"] if where == "flags" else []
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--port",
                          str(free_port()), *flags], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 2 and "redis-server" not in out.stdout, out.stdout + out.stderr
    assert out.stderr.startswith("pdpool up: error: prefill-0 runs on cuda") and "engine.device: cpu" in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_an_attention_backend_the_device_cannot_run_is_refused_before_anything_starts(tmp_path):
    """`pdpool up -- --attention-backend triton` on the CPU (the pool's engine.device) without TRITON_INTERPRET:
    each node exits 1 at load on it (pdpool.attention.backend), and was restarted, with backoff, forever."""
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(DEFAULT_POOL))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--port",
                          str(free_port()), "--", "--attention-backend", "triton"], capture_output=True, text=True,
                         timeout=60, env=dict(env, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 2 and "redis-server" not in out.stdout, out.stdout + out.stderr
    assert out.stderr.startswith("pdpool up: error: prefill-0") and (
        "--attention-backend triton needs --device cuda (this node runs on cpu)") in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_a_model_that_is_not_here_is_refused_before_anything_starts(tmp_path):
    """Every node and the router failed on it with a traceback and restarted, with backoff, forever."""
    body = copy.deepcopy(DEFAULT_POOL)
    body["spec"]["model"]["name"] = str(tmp_path / "no-model")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(tmp_path / "p.yaml"), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PDPOOL_CACHE=str(tmp_path), HF_HUB_CACHE=str(tmp_path / "hub")))
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == (f"pdpool up: error: model.name '{tmp_path / 'no-model'}': not 'demo', not a local folder "
                          f"with a config.json, and not a model in the Hugging Face cache ({tmp_path / 'hub'}) "
                          "(models are never downloaded)\n")


def test_an_unreachable_redis_is_one_error_and_nothing_to_clean(tmp_path):
    """Nothing started: no 'could not clean the pool's Redis keys' after the error (it tried the same dead Redis)."""
    path = external_redis_pool(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", str(path), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "error: cannot reach the pool's Redis at redis://127.0.0.1:" in out.stdout
    assert "could not clean" not in out.stdout and "Traceback" not in out.stderr


def test_an_ipv6_router_address_makes_valid_urls():
    pool, _ = load_pool(None)
    assert router_spec(pool, "::1", 8123, "redis://127.0.0.1:1").url == "http://[::1]:8123"
    assert router_spec(pool, "::", 8123, "redis://127.0.0.1:1").url == "http://127.0.0.1:8123"


@pytest.mark.parametrize("url", [None, "http://127.0.0.1:{port}/v1", "127.0.0.1:{port}"])
def test_status_with_nothing_running_is_one_line_of_error(tmp_path, url):
    """--url of a router nobody runs printed an empty table with 'unreachable' and exit 0; a URL without its
    scheme (as curl takes it) was 'unknown url type'."""
    args = [] if url is None else ["--url", url.format(port=free_port())]
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "status", *args], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 1 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith("pdpool status: ") and len(out.stderr.splitlines()) == 1, out.stderr
    assert "unknown url type" not in out.stderr


def test_a_state_file_whose_pid_is_now_another_program_is_stale(tmp_path, monkeypatch):
    """After a reboot (or a container's restart) the pid of a killed `pdpool up` runs something else: its state
    file was taken for a running pool (`pdpool status` showed it, and the next up never cleaned it)."""
    from pdpool.up import state

    monkeypatch.setenv("PDPOOL_CACHE", str(tmp_path))
    other = subprocess.Popen(["sleep", "60"])
    try:
        path = state.state_path(free_port())
        run_dir = tmp_path / "run-stale"
        run_dir.mkdir()
        state.write(path, {"pid": other.pid, "pool": "demo", "namespace": "default", "model": "demo",
                           "router_url": "http://127.0.0.1:1", "ready": True, "redis_url": None,
                           "redis_password": None, "redis_pid": None, "run_dir": str(run_dir), "processes": []})
        assert state.running() == []
        assert state.reap_stale() == [(other.pid, [])]
        assert not path.exists() and not run_dir.exists()
        assert other.poll() is None, "a process that is not the pool's is left alone"
    finally:
        other.kill()
        other.wait()


def test_default_example_is_one_prefill_one_decode_on_cpu():
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", "--dry-run", "--port", "8123"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = {line.split(":", 1)[0].split("| ", 1)[1]: line for line in out.stdout.splitlines()}
    assert sorted(lines) == ["decode-0", "prefill-0", "router-0"]
    for role in ("prefill", "decode"):
        line = lines[f"{role}-0"]
        for flag in (f"--role {role}", f"--node-id {role}-0", "--ucx-tls tcp,self", "--num-threads 1",
                     "--pool demo", "--host 127.0.0.1", "--kv-lease-seconds 10"):
            assert flag in line, (flag, line)
    assert "pdpool router" in lines["router-0"] and "--port 8123" in lines["router-0"]
    assert "internal" not in out.stdout.lower()  # secrets travel in the environment, never in argv


def test_kubernetes_discovery_in_the_file_still_finds_local_nodes_by_heartbeat(tmp_path):
    body = copy.deepcopy(DEFAULT_POOL)
    body["spec"].setdefault("router", {})["discovery"] = "kubernetes"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    pool, ignored = load_pool(tmp_path / "p.yaml")
    assert "router.discovery" in ignored
    spec = router_spec(pool, "127.0.0.1", 8123, "redis://127.0.0.1:1")
    assert "--kubernetes" not in spec.argv and "--redis" in spec.argv


def dry_run_configs(*args: str) -> tuple[object, dict]:
    """``pdpool up --dry-run ARGS``, each line parsed back by `pdpool router`'s and `pdpool serve`'s own parsers:
    (the router's config, {node name: its config})."""
    import argparse
    import shlex

    from pdpool import config
    from pdpool.router import settings

    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", "--dry-run", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argvs = {line.split("| ", 1)[1].split(":", 1)[0]: shlex.split(line.split(" pdpool ", 1)[1])
             for line in out.stdout.splitlines() if " pdpool " in line}
    router, _ = settings.load(argvs.pop("router-0")[1:], environ={})
    nodes = {}
    for name, argv in argvs.items():
        assert argv[0] == "serve"
        parser = argparse.ArgumentParser()
        config.add_arguments(parser)
        nodes[name] = config.from_args(parser.parse_args(argv[1:]), environ={})
    return router, nodes


def test_cors_in_the_file_reaches_the_router_and_the_nodes(tmp_path):
    """The spec's cors section (as the operator reads it) gives every process the CORS flags; each line of
    --dry-run is parsed back by `pdpool router`'s and `pdpool serve`'s own parsers."""
    cors = {"allowedOrigins": ["https://app.example", "http://localhost:3000"], "allowCredentials": True,
            "allowedHeaders": []}
    body = copy.deepcopy(DEFAULT_POOL)
    body["spec"]["cors"] = cors
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    router, nodes = dry_run_configs(str(tmp_path / "p.yaml"), "--port", "8123")
    assert sorted(nodes) == ["decode-0", "prefill-0"]
    sections = [router.router, *(node.server for node in nodes.values())]
    for section in sections:
        assert (section.allowed_origins, section.allow_credentials, section.allowed_methods,
                section.allowed_headers) == (cors["allowedOrigins"], True, ["*"], [])


@pytest.mark.parametrize("flags", [
    ["--served-model-name", "foo"],
    ["--model", "demo", "--served-model-name", "a", "b"],
    ["--block-size", "32", "--dtype", "float32"],
    ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"],
    ["--allowed-origins", "https://app.example", "--no-allow-credentials"],
])
def test_flags_after_dashes_that_the_router_shares_reach_it_too(flags):
    """`pdpool up -- --served-model-name foo` ran nodes that served 'foo' behind a router that served 'demo': up
    said the pool was ready, printed a curl line for 'demo', and every request was a 404 model_not_found, from the
    nodes for 'demo' and from the router for 'foo'. A setting both commands take (the model, its served name, the
    block-hash fingerprint's dtype and block size, chat template and tool-call settings, CORS) is the pool's, so it
    reaches the router as the operator's pool fields do."""
    from pdpool import config

    router, nodes = dry_run_configs("--port", "8123", "--", *flags)
    router_flags = {config.flag_name(f): f for _, f in config.all_options(config.RouterCommandConfig)}
    wiring = {"--host", "--port", "--redis", "--pool", "--namespace", "--config", "--api-key", "--internal-token",
              "--redis-password"}
    shared = 0
    for node in nodes.values():
        assert node.served_model_name == router.served_model_name
        for sec, f in config.all_options(config.NodeConfig):
            name = config.flag_name(f)
            if name in router_flags and name not in wiring:
                theirs = getattr(getattr(node, sec), f.name)
                ours = getattr(router.router, router_flags[name].name)
                assert ours == theirs or (isinstance(theirs, list) and [ours] == theirs[:1]), (name, ours, theirs)
                shared += 1
    assert shared >= 2 * 12


@pytest.mark.parametrize("flags, message", [
    (["--port", "9000"], "--port"),
    (["--role", "decode"], "--role"),
    (["--node-id", "x"], "--node-id"),
    (["--redis", "redis://127.0.0.1:1/0"], "--redis"),
    (["--pool", "other"], "--pool"),
    (["--host", "0.0.0.0"], "--host"),
    (["--internal-token", "t"], "--internal-token"),
    (["--api-key", "k"], "PDPOOL_API_KEY"),
    (["--config", "node.yaml"], "--config"),
])
def test_flags_after_dashes_that_up_sets_itself_are_one_line_of_error(tmp_path, flags, message):
    """`pdpool up -- --port 9000` put every node on port 9000 (all but one exited, and were restarted forever);
    `-- --role decode` made the prefill nodes decode nodes; `-- --api-key k` guarded the nodes but not the router;
    `-- --config node.yaml` gave the nodes settings (a served name) the router did not get.
    `up` wires these itself, per process, or passes them in the environment: refused before anything starts (and
    by --dry-run, which the test runs so that the old code, which started the pool, leaves nothing behind)."""
    (tmp_path / "node.yaml").write_text("served-model-name: foo\n")
    flags = [str(tmp_path / f) if f == "node.yaml" else f for f in flags]
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", "--dry-run", "--port", "8123", "--", *flags],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PDPOOL_CACHE=str(tmp_path)))
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith("pdpool up: error: ") and message in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_missing_redis_server_says_how_to_install_it(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), PDPOOL_CACHE=str(tmp_path))  # no redis-server on PATH
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "up", "--port", str(free_port())], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "apt-get install -y redis-server" in out.stderr


def test_missing_nixl_says_how_to_install_it(monkeypatch, capsys):
    """`pip install -e .` alone has no NIXL: up says so before it starts anything (else every node fails, forever)."""
    import importlib.util

    from pdpool.up import main as up_main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in up_main.NIXL_PACKAGES else find_spec(name, *a))
    assert up_main.main(["--port", str(free_port())]) == 1
    assert "pip install 'pdpool[nixl]'" in capsys.readouterr().err


def test_managed_redis_and_sigterm_while_starting(demo_model_dir, pdpool_cache, tmp_path):
    """No nodes (replicas 0): the router never gets ready. The pool's own Redis, killed, is restarted; SIGTERM then
    stops the router and Redis."""
    port = free_port()
    up = UpProcess([str(empty_pool(tmp_path, "empty")), "--port", str(port)],
                   dict(os.environ, PDPOOL_CACHE=str(pdpool_cache)))
    try:
        up.wait_for_line(r"^router-0 +\| .*listening", timeout=120)
        state_path = Path(pdpool_cache) / "up" / f"{port}.json"
        saved = json.loads(state_path.read_text())
        assert saved["redis_url"].startswith("redis://127.0.0.1:") and saved["redis_pid"]
        os.kill(saved["redis_pid"], signal.SIGKILL)  # the pool's Redis is supervised too
        up.wait_for_line(r"^up +\| redis-server exited with code -9; restarting it", timeout=30)
        deadline = time.monotonic() + 30
        while json.loads(state_path.read_text())["redis_pid"] == saved["redis_pid"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pids = [saved["redis_pid"], json.loads(state_path.read_text())["redis_pid"],
                *(p["pid"] for p in saved["processes"])]
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0, up.log()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    assert_gone(pids)
    assert "redis-server stopped" in up.log() and any(line.startswith("redis     | ") for line in up.lines)
    assert not (Path(pdpool_cache) / "up" / f"{port}.json").exists()


def test_a_second_signal_kills_everything_and_says_so_in_the_exit_code(demo_model_dir, pdpool_cache, tmp_path):
    """The first SIGTERM stops cleanly; a router that does not stop (SIGSTOP here, a long stream in real life) gets
    the second one: every process is killed at once, and the exit code is 128 + that signal (it was 0, as for a
    clean stop)."""
    port = free_port()
    up = UpProcess([str(empty_pool(tmp_path, "twice")), "--port", str(port)],
                   dict(os.environ, PDPOOL_CACHE=str(pdpool_cache)))
    try:
        up.wait_for_line(r"^router-0 +\| .*listening", timeout=120)
        saved = json.loads((Path(pdpool_cache) / "up" / f"{port}.json").read_text())
        pids = [saved["redis_pid"], *(p["pid"] for p in saved["processes"])]
        (router,) = (p["pid"] for p in saved["processes"] if p["role"] == "router")
        os.kill(router, signal.SIGSTOP)
        up.proc.send_signal(signal.SIGTERM)
        up.wait_for_line(r"^up +\| stopping:", timeout=30)
        time.sleep(1.5)  # past the debounce: a second signal, not the first one forwarded twice
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 128 + signal.SIGTERM, up.log()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    assert "second signal: killing every process now" in up.log()
    assert_gone(pids)


def empty_pool(tmp_path: Path, name: str) -> Path:
    body = copy.deepcopy(DEFAULT_POOL)
    body["metadata"]["name"] = name
    body["spec"]["prefill"]["replicas"] = body["spec"]["decode"]["replicas"] = 0
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return tmp_path / f"{name}.yaml"


def test_what_a_killed_up_left_running_is_stopped_by_the_next_up(demo_model_dir, pdpool_cache, tmp_path):
    env = dict(os.environ, PDPOOL_CACHE=str(pdpool_cache))
    port = free_port()
    first = UpProcess([str(empty_pool(tmp_path, "first")), "--port", str(port)], env)
    second = None
    try:
        first.wait_for_line(r"^router-0 +\| .*listening", timeout=120)
        saved = json.loads((Path(pdpool_cache) / "up" / f"{port}.json").read_text())
        pids = [saved["redis_pid"], *(p["pid"] for p in saved["processes"])]
        assert Path(saved["run_dir"]).is_dir()
        first.proc.kill()  # SIGKILL: no chance to stop its children
        first.proc.wait()
        for pid in pids:
            os.kill(pid, 0)  # still running
        second = UpProcess([str(empty_pool(tmp_path, "second")), "--port", str(free_port())], env)
        second.wait_for_line(rf"^up +\| stopped 2 processes left running by a killed pdpool up \(pid {first.proc.pid}\)",
                             timeout=60)
        assert_gone(pids)
        assert not Path(saved["run_dir"]).exists()
    finally:
        for up in (first, second):
            if up is not None and up.proc.poll() is None:
                up.proc.send_signal(signal.SIGTERM)
                up.proc.wait(60)


def test_a_pool_with_an_api_key_serves_requests_that_present_it(demo_model_dir, pdpool_cache, tmp_path):
    """PDPOOL_API_KEY in up's environment reaches the router and the nodes, as the operator's
    router.apiKeySecretRef does (docs/deploy.md). The router checked the client's key and forwarded the request
    with the internal token alone; each node, holding the key too, answered it 401 invalid_api_key, so a pool with a
    key refused every request, the right key included. The router now presents its key to its nodes."""
    port = free_port()
    env = dict(os.environ, PDPOOL_CACHE=str(pdpool_cache), PDPOOL_API_KEY="sk-pool")
    up = UpProcess(["--port", str(port)], env)
    try:
        up.wait_for_line(r"^up +\| pool demo is ready", timeout=240)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=120).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-pool"}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        up.proc.send_signal(signal.SIGTERM)
        try:
            up.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(up.proc.pid, signal.SIGKILL)


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    """No process left with these pids, nor in their process groups (a killed orphan's zombie may linger until
    init reaps it: wait for that, boundedly)."""
    def gone(pid: int) -> bool:
        for probe in (os.kill, os.killpg):
            try:
                probe(pid, 0)
                return False
            except ProcessLookupError:
                pass
        return True

    deadline = time.monotonic() + timeout
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if not gone(pid)]
        time.sleep(0.1)


# ---- a running pool -----------------------------------------------------------------------------------------

def test_kubernetes_only_fields_are_named_once(up):
    ignored = [line for line in up.lines if "ignoring Kubernetes-only fields" in line]
    assert ignored == ["up        | ignoring Kubernetes-only fields: prefill.resources"]


def test_openai_client_through_the_router_is_disaggregated(up):
    procs = processes(up)
    assert sorted(procs) == ["decode-0", "decode-1", "prefill-0", "router-0"]
    assert all(p["state"] == "ready" for p in procs.values())
    reference = client(procs["prefill-0"]["url"] + "/v1")  # served end to end by one node: the expected text
    router = client(f"http://127.0.0.1:{up.port}/v1")
    want = reference.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    want_chat = reference.chat.completions.create(model="demo", messages=CHAT, max_tokens=8,
                                                  temperature=0).choices[0].message.content
    before = decisions(up, "disaggregated")
    got = router.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == want and got.usage.completion_tokens == 8
    chat = router.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == want_chat
    assert decisions(up, "disaggregated") == before + 2
    pulled = sum(parse_metrics(httpx.get(procs[d]["url"] + "/metrics", timeout=10).text)
                 .get("pdpool_kv_pulled_bytes_total", 0.0) for d in ("decode-0", "decode-1"))
    assert pulled > 0  # the KV moved from the prefill node to a decode node
    assert up.wait_for_line(r"^up +\|   curl -s http://127\.0\.0\.1:\d+/v1/completions", 1)
    assert up.wait_for_line(r"^up +\|   python -c \"from openai import OpenAI", 1)
    assert all(LINE.match(line) for line in up.lines), [line for line in up.lines if not LINE.match(line)][:5]
    for name in ("prefill-0", "decode-0", "decode-1", "router-0", "up"):
        assert any(line.startswith(f"{name} ") for line in up.lines), name


def test_status_prints_nodes_and_route_decisions(up):
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "status"], env=up.env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    assert rows["NAME"][:8] == ["NAME", "ROLE", "STATE", "RUNNING", "WAITING", "KV-USAGE", "PREFIX-HIT", "RESTARTS"]
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        assert rows[name][1:3] == [role, "ready"], out.stdout
        assert rows[name][5].endswith("%"), out.stdout  # KV usage
        # prefix hits: "-" on a node that has not looked a prompt up yet (the router may have sent it nothing)
        assert rows[name][6].endswith("%") or rows[name][6] == "-", out.stdout
    assert any(rows[name][6].endswith("%") for name in ("decode-0", "decode-1")), out.stdout
    assert rows["ROUTER"][1:5] == ["DISAGGREGATED", "DECODE-ONLY", "FALLBACK", "RETRY"]
    assert int(rows["router-0"][1]) == decisions(up, "disaggregated") >= 2, out.stdout
    by_url = subprocess.run([sys.executable, "-m", "pdpool.cli", "status", "--url", f"http://127.0.0.1:{up.port}/v1"],
                            env=up.env, capture_output=True, text=True, timeout=60)
    # The same report through the router's URL. The load columns are live (heartbeats land every second or so),
    # so they are compared by shape only; everything else must be identical.
    assert stable_view(by_url.stdout) == stable_view(out.stdout)


def stable_view(report: str) -> list[list[str]]:
    live = {"RUNNING", "WAITING", "KV-USAGE", "PREFIX-HIT"}
    rows, header = [], []
    for line in report.splitlines():
        cells = line.split()
        if cells[:1] == ["NAME"]:
            header = cells
        elif header and len(cells) == len(header) and cells[0] != "ROUTER":
            cells = ["*" if h in live else c for h, c in zip(header, cells)]
        elif cells[:1] == ["ROUTER"]:
            header = []
        rows.append(cells)
    return rows


def test_bench_against_the_pool_writes_json_and_pngs_with_consistent_counts(up, tmp_path):
    from pdpool.bench import datasets
    from pdpool.frontend import Frontend

    before = router_metrics(up)
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", "--url", f"http://127.0.0.1:{up.port}",
                           "--model", "demo", "--tokenizer", "demo", "--random-token-ids", "--random-input-len",
                           "20:40", "--random-output-len", "2:4", "--num-requests", "5", "--concurrency", "2",
                           "--ignore-eos", "--seed", "3", "--time-limit", "180", "--out", str(out), "--no-progress"],
                          env=up.env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"bench.json", "latency_cdf.png", "ttft_over_time.png"} <= {p.name for p in out.iterdir()}
    (run,) = json.loads((out / "bench.json").read_text())["runs"]
    expected = datasets.random_requests(5, (20, 40), (2, 4), datasets.Lengths(Frontend.from_model("demo")), seed=3,
                                        token_ids=True)
    assert [r["index"] for r in run["records"]] == list(range(5)) and run["summary"]["completed"] == 5
    for record, req in zip(run["records"], expected):  # the responses' usage, for exactly these requests
        assert record["usage_reported"] and record["error"] is None
        assert (record["prompt_tokens"], record["completion_tokens"]) == (len(req.prompt), req.max_tokens)
    assert run["summary"]["total_input_tokens"] == sum(len(r.prompt) for r in expected)
    assert run["summary"]["total_output_tokens"] == sum(r.max_tokens for r in expected)
    after = router_metrics(up)
    key = 'pdpool_router_requests_total{decision="disaggregated"}'
    assert after[key] - before.get(key, 0.0) == 5  # every request took the disaggregated path


def test_a_killed_decode_node_restarts_and_requests_keep_succeeding(up):
    victim = processes(up)["decode-0"]
    os.kill(victim["pid"], signal.SIGKILL)
    up.killed_pids = [victim["pid"]]
    router = client(f"http://127.0.0.1:{up.port}/v1")
    served, router_saw_it_leave = 0, False
    deadline = time.monotonic() + 180
    while True:  # requests go on the whole time the node is gone and coming back
        r = router.completions.create(model="demo", prompt=f"{served}: {PROMPT}", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        served += 1
        usable = router_metrics(up).get('pdpool_router_nodes{role="decode",usable="true"}', 0)
        router_saw_it_leave = router_saw_it_leave or usable < 2
        now = processes(up)["decode-0"]
        if now["restarts"] == 1 and now["state"] == "ready" and now["pid"] != victim["pid"]:
            break
        assert time.monotonic() < deadline, f"decode-0 not back: {now}\n" + up.log()[-4000:]
        time.sleep(0.5)
    assert up.wait_for_line(r"^up +\| decode-0 exited with code -9; restarting in 1s", 1)
    # the router's discovery saw it come back: both decode nodes usable again, and it serves
    deadline = time.monotonic() + 30
    while router_metrics(up).get('pdpool_router_nodes{role="decode",usable="true"}', 0) < 2:
        assert time.monotonic() < deadline, "the router did not see decode-0 come back"
        time.sleep(0.5)
    assert router.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert served >= 2 and router_saw_it_leave


def test_sigterm_stops_everything(up, redis_module):
    saved = state(up)
    pids = [p["pid"] for p in saved["processes"]] + getattr(up, "killed_pids", [])
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(120) == 0, up.log()[-4000:]
    assert_gone(pids)
    keys = list(redis_module.client().scan_iter(match=PoolKeys("default", POOL).scan_pattern))
    assert keys == []
    assert not up.state_path.exists()
    assert redis_module.client().ping()  # an external Redis is the pool's, not ours: left running
