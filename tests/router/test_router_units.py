"""The router's pure parts: plugins, the approximate index, the SSE relay, settings and the CLI (no nodes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest
from hypothesis import given, strategies as st

from pdpool import config
from pdpool.router import settings
from pdpool.router.endpoints import Endpoint, Load
from pdpool.router.filters import LoadMarginFilter
from pdpool.router.inflight import InflightTracker
from pdpool.router.pickers import MaxScorePicker, RoundRobinPicker
from pdpool.router.plugins import Context
from pdpool.router.prefix_index import ApproxIndex, PrefixIndex, PyApproxIndex
from pdpool.router.scorers import KVUsageScorer, PrefixCacheScorer, QueueScorer
from pdpool.router.sse import SSERelay


def make_endpoint(node_id: str, **load) -> Endpoint:
    return Endpoint(node_id, f"http://{node_id}", "decode", load=Load(**load))


def make_ctx(matched: dict, tokens: int = 160, inflight: InflightTracker | None = None) -> Context:
    return Context("decode", tokens, 16, matched, inflight or InflightTracker())


def test_prefix_scorer_is_matched_over_prompt_blocks():
    eps = [make_endpoint("a"), make_endpoint("b")]
    assert PrefixCacheScorer().score(make_ctx({"a": 5, "b": 0}), eps) == {"a": 0.5, "b": 0.0}


def test_queue_scorer_counts_the_routers_own_inflight_at_once():
    tracker = InflightTracker()
    eps = [make_endpoint("a"), make_endpoint("b")]
    for _ in range(4):
        tracker.add("a", 100)
    scores = QueueScorer(maxQueue=8).score(make_ctx({}, inflight=tracker), eps)
    assert scores == {"a": 0.5, "b": 1.0}


def test_kv_usage_scorer():
    assert KVUsageScorer().score(make_ctx({}), [make_endpoint("a", kv_usage=0.25)]) == {"a": 0.75}


def test_ties_are_broken_at_random():
    picker = MaxScorePicker()
    eps = [make_endpoint("a"), make_endpoint("b")]
    firsts = {picker.rank(make_ctx({}), [(e, 1.0) for e in eps])[0].node_id for _ in range(64)}
    assert firsts == {"a", "b"}


def test_round_robin_alternates():
    picker = RoundRobinPicker()
    eps = [(make_endpoint("a"), 0.0), (make_endpoint("b"), 5.0)]
    assert [picker.rank(make_ctx({}), eps)[0].node_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_affinity_yields_to_load_beyond_the_margin():
    tracker = InflightTracker()
    hot, cold = make_endpoint("hot"), make_endpoint("cold")
    ctx = make_ctx({"hot": 8, "cold": 0}, inflight=tracker)
    f = LoadMarginFilter(marginTokens=1000)
    assert f.filter(ctx, [hot, cold]) == [hot, cold]
    for _ in range(11):
        tracker.add("hot", 100)  # 1100 queued prefill tokens on the best-prefix node
    # 1100 + 32 uncached here against 160 uncached on the cold node: moving would cost the prompt again
    assert f.filter(ctx, [hot, cold]) == [hot, cold]
    tracker.add("hot", 100)
    assert f.filter(ctx, [hot, cold]) == [cold]  # 1232 - 160 > 1000
    assert ctx.events == ["affinity_yield"]


def test_approx_index_counts_leading_blocks_of_the_current_incarnation():
    idx = ApproxIndex(capacity=100)
    hashes = [bytes([i]) * 16 for i in range(6)]
    idx.record(hashes[:4], "a", "inc1")
    idx.record(hashes[:2], "b", "x")
    assert idx.lookup(hashes, {"a": "inc1", "b": "x", "c": None}) == {"a": 4, "b": 2, "c": 0}
    assert idx.lookup(hashes, {"a": "inc2"}) == {"a": 0}  # restarted: old entries ignored


def _walk_forward(idx: ApproxIndex, hashes, incarnations, since=None) -> dict[str, int]:
    """The definition the backward scan must agree with: a node's run of valid entries from block 0."""
    matched = {}
    for n, inc in incarnations.items():
        run = 0
        while run < len(hashes):
            entry = idx.owner(hashes[run], n)
            if entry is None or entry[0] != inc or (since is not None and entry[1] < since):
                break
            run += 1
        matched[n] = run
    return matched


PATHS = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 8, 9, 10], [0, 11, 12], [13, 14, 15, 16]]  # a prompt tree


def _chained_hashes():
    """hashes_of(path): chained 16-byte block hashes for a path in a tree of prompts, one fresh hash per
    (parent, block), so two paths share exactly their common prefix's hashes."""
    chained = {}

    def hashes_of(nodes):
        out, parent = [], b""
        for b in nodes:
            parent = chained.setdefault((parent, b), bytes([len(chained)]) * 16)
            out.append(parent)
        return out

    return hashes_of


# ApproxIndex is the C table where the native module builds (tests/router/test_approx_index_native.py), and
# PyApproxIndex the fallback: both are held to the definitions below.
APPROX_KINDS = pytest.mark.parametrize("make_index", [ApproxIndex, PyApproxIndex], ids=["chosen", "python"])


@APPROX_KINDS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.sampled_from("abc"), st.booleans()),
                max_size=25),
       st.integers(0, 3), st.integers(0, 30))
def test_approx_index_backward_scan_is_the_forward_walk(make_index, records, path, since):
    """Prompts are chained hashes, recorded whole (a prefix of a path in a tree of prompts), under node
    incarnations that only move forward: the backward scan finds each node's leading run."""
    hashes_of = _chained_hashes()

    idx = make_index(capacity=10_000)
    incarnations = {"a": 0, "b": 0, "c": 0}
    for t, (p, length, node, restart) in enumerate(records):
        if restart:
            incarnations[node] += 1
        idx.record(hashes_of(PATHS[p][:length]), node, incarnations[node], now=float(t))
    hashes = hashes_of(PATHS[path])
    for window in (None, float(since)):
        assert idx.lookup(hashes, incarnations, since=window) == _walk_forward(idx, hashes, incarnations, window)


@APPROX_KINDS
def test_approx_index_is_bounded(make_index):
    idx = make_index(capacity=10)
    idx.record([bytes([i]) * 16 for i in range(50)], "a", None)
    assert len(idx) == 10


SSE = (b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
       b'data: {"choices": [{"text": "b"}], "usage": null}\n\n'
       b'data: {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}\n\n'
       b"data: [DONE]\n\n")


@given(st.lists(st.integers(1, len(SSE)), max_size=12))
def test_sse_relay_hides_usage_whatever_the_chunking(cuts):
    relay = SSERelay(hide_usage=True)
    points = sorted(set(c for c in cuts if c < len(SSE)))
    out = b""
    for a, b in zip([0, *points], [*points, len(SSE)]):
        out += relay.feed(SSE[a:b])
    out += relay.tail()
    assert out == b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
    assert relay.done and relay.usage["prompt_tokens_details"]["cached_tokens"] == 8


def test_sse_relay_passes_usage_through_when_asked():
    relay = SSERelay(hide_usage=False)
    assert relay.feed(SSE) == SSE and relay.done


def test_yaml_config_and_flags(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("decode: [http://d0:8000, http://d1:8000]\nmax-inflight: 7\nport: 9000\n"
                    "scheduler:\n  scorers:\n    - {type: prefix-cache-scorer, weight: 5}\n"
                    "    - {type: queue-scorer, weight: 1, parameters: {maxQueue: 4}}\n"
                    "  picker: {type: random-picker}\n")
    cfg, sched = settings.load(["--config", str(path), "--port", "9100"], environ={})
    assert cfg.router.decode == ["http://d0:8000", "http://d1:8000"]
    assert cfg.router.max_inflight == 7 and cfg.router.port == 9100  # the flag wins
    prof = settings.profile(cfg, sched)
    assert [(s.type_name, w) for s, w in prof.scorers] == [("prefix-cache-scorer", 5.0), ("queue-scorer", 1.0)]
    assert prof.picker.type_name == "random-picker"
    default = settings.profile(*settings.load(["--redis", "redis://x"], environ={}))
    assert [(s.type_name, w) for s, w in default.scorers] == [
        ("prefix-cache-scorer", 3.0), ("queue-scorer", 2.0), ("kv-usage-scorer", 2.0)]
    assert [f.type_name for f in default.filters] == ["load-margin-filter"]


def test_workers_recent_window_and_token_cache_come_from_the_flags(tmp_path, demo_model_dir):
    from pdpool.frontend import Frontend
    from pdpool.router.app import Router

    path = tmp_path / "router.yaml"
    path.write_text("both: http://n0:8000\nrecent-seconds: 2.5\ntoken-cache-chunks: 16\n")
    cfg, sched = settings.load(["--config", str(path), "--workers", "3"], environ={})
    assert (cfg.router.workers, cfg.router.recent_seconds, cfg.router.token_cache_chunks) == (3, 2.5, 16)
    router = Router(cfg, settings.profile(cfg, sched), Frontend.from_model("demo", cfg.router.token_cache_chunks))
    assert router.index.recent_seconds == 2.5 and router.frontend.token_cache.capacity == 16
    defaults, _ = settings.load(["--both", "http://n0:8000"], environ={})
    assert (defaults.router.workers, defaults.router.recent_seconds, defaults.router.token_cache_chunks) == (
        1, 5.0, 8192)
    with pytest.raises(settings.SettingsError, match="--workers: 0 is below the minimum 1"):
        settings.load(["--workers", "0"], environ={})


def test_cors_settings_come_from_the_yaml_a_flag_winning(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("allowed-origins: https://a.example\nallow_credentials: true\nallowed-headers: [X-A, X-B]\n")
    cfg, _ = settings.load(["--config", str(path), "--allowed-headers", "X-C"], environ={})
    r = cfg.router
    assert (r.allowed_origins, r.allow_credentials, r.allowed_methods, r.allowed_headers) == (
        ["https://a.example"], True, ["*"], ["X-C"])


@pytest.mark.parametrize("yaml_text, message", [
    ("nonsense: 1\n", "unknown setting"),
    ("scheduler:\n  scorers: [{type: no-such-scorer}]\n", "unknown scheduling plugin"),
    ("scheduler:\n  picker: {type: queue-scorer}\n", "not a rank plugin"),
])
def test_bad_yaml_is_a_clear_error(tmp_path, yaml_text, message):
    path = tmp_path / "router.yaml"
    path.write_text(yaml_text)
    with pytest.raises(settings.SettingsError, match=message):
        settings.profile(*settings.load(["--config", str(path)], environ={}))


def test_repeatable_flags_round_trip_through_to_argv():
    cfg, _ = settings.load(["--decode", "http://a", "--decode", "http://b", "--both", "http://c"], environ={})
    argv = config.to_argv(cfg, config.RouterCommandConfig)
    assert argv == ["--decode", "http://a", "--decode", "http://b", "--both", "http://c"]
    again, _ = settings.load(argv, environ={})
    assert again == cfg


def test_flags_in_underscores_parse_as_pdpool_serve_and_vllm_take_them():
    cfg, _ = settings.load(["--max_inflight", "8", "--node_cooldown=0.5", "--both", "http://n0:8000"], environ={})
    assert (cfg.router.max_inflight, cfg.router.node_cooldown) == (8, 0.5)


def test_operator_rendered_args_parse_with_the_real_cli():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
    from operator_examples import NAMES, example_body  # the operator tests' example pools

    from pdpool.operator.builders.router import router_deployment
    from pdpool.operator.spec import parse_pool

    for name in NAMES:
        body = example_body(name)
        container = router_deployment(parse_pool(body))["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["pdpool"] and container["args"][0] == "router"
        cfg, sched = settings.load(container["args"][1:], environ={})
        settings.profile(cfg, sched)
        assert cfg.router.redis and cfg.router.pool == body["metadata"]["name"], name


def test_the_router_never_imports_torch():
    code = ("import sys; from pdpool.router import main, app, handoff, discovery_redis, discovery_static; "
            "from pdpool.router.settings import load, profile; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_without_a_discovery_source_exits_2():
    r = subprocess.run([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "no discovery source" in r.stderr


class _EmptyRedis:
    """An IndexReader whose Redis holds nothing yet (the nodes have not published the prefix)."""

    def lookup(self, hashes):
        return {}


def _precise_index(recent_seconds: float) -> PrefixIndex:
    async def run_sync(fn, *args):
        return fn(*args)

    return PrefixIndex(_EmptyRedis(), ApproxIndex(100), run_sync, recent_seconds=recent_seconds)


def test_a_prefix_just_routed_counts_before_the_node_publishes_it():
    import asyncio
    import time

    index = _precise_index(recent_seconds=5.0)
    hashes = [bytes([i]) * 16 for i in range(4)]
    a, b = make_endpoint("a"), make_endpoint("b")
    index.record(hashes[:3], a)
    assert asyncio.run(index.lookup(hashes, [a, b])) == {"a": 3, "b": 0}
    index.approx.record(hashes, "b", None, now=time.monotonic() - 6.0)  # routed too long ago: Redis decides
    assert asyncio.run(index.lookup(hashes, [a, b])) == {"a": 3, "b": 0}
    assert asyncio.run(_precise_index(recent_seconds=0).lookup(hashes, [a, b])) == {"a": 0, "b": 0}


def test_the_router_runs_on_uvloop_when_installed_and_on_asyncio_without(monkeypatch):
    import asyncio

    from pdpool.router.main import run

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    seen: list[str] = []

    async def record() -> None:
        seen.append(await loop_module())

    import uvloop  # noqa: F401 - a dependency of pdpool

    run(record())
    monkeypatch.setitem(sys.modules, "uvloop", None)   # import uvloop -> ImportError
    run(record())
    assert seen[0].startswith("uvloop") and seen[1].startswith("asyncio")


def test_fresh_request_ids_are_unique_hex_and_differ_across_a_fork():
    import os
    import re

    from pdpool.router.app import new_request_id

    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # a forked worker draws its own prefix
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert re.fullmatch(r"[0-9a-f]{32}", child) and child[:16] != ids[0][:16]


class _DictApprox:
    """The approximate index as it was before its compact form (every hash -> {node: (incarnation, time)}): the
    reference the compact one must agree with, LRU order included."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self.lru = OrderedDict()

    def record(self, hashes, node_id, incarnation, now) -> None:
        for h in hashes:
            owners = self.lru.get(h)
            if owners is None:
                self.lru[h] = {node_id: (incarnation, now)}
                if len(self.lru) > self.capacity:
                    self.lru.popitem(last=False)
            else:
                owners[node_id] = (incarnation, now)
                self.lru.move_to_end(h)

    def lookup(self, hashes, incarnations, since=None) -> dict[str, int]:
        matched = {n: 0 for n in incarnations}
        for i in range(len(hashes) - 1, -1, -1):
            for n, (incarnation, recorded) in (self.lru.get(hashes[i]) or {}).items():
                if matched.get(n) == 0 and incarnation == incarnations[n] and (since is None or recorded >= since):
                    matched[n] = i + 1
        return matched


@APPROX_KINDS
@hypothesis.settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.sampled_from("abc"), st.booleans()),
                max_size=30),
       st.integers(1, 20), st.integers(0, 3), st.integers(0, 30))
def test_compact_approx_index_is_the_dict_of_owners(make_index, records, capacity, path, since):
    hashes_of = _chained_hashes()

    idx, ref = make_index(capacity), _DictApprox(capacity)
    incarnations = {"a": 0, "b": 0, "c": 0}
    for t, (p, length, node, restart) in enumerate(records):
        if restart:
            incarnations[node] += 1
        idx.record(hashes_of(PATHS[p][:length]), node, incarnations[node], now=float(t))
        ref.record(hashes_of(PATHS[p][:length]), node, incarnations[node], float(t))
        assert idx.keys() == list(ref.lru)               # the same hashes in the same LRU order
        for h, owners in ref.lru.items():
            for n in "abc":
                assert idx.owner(h, n) == owners.get(n)
    for p in range(len(PATHS)):
        hashes = hashes_of(PATHS[p])
        for window in (None, float(since)):
            assert idx.lookup(hashes, incarnations, since=window) == ref.lookup(hashes, incarnations, window)


def test_a_prefill_node_standing_in_for_decode_is_not_sent_a_handoff():
    """With no usable decode node, a prefill node serves requests whole: the plan must not also pick a prefill leg
    (a prefill-role node refuses a decode leg's kv_transfer_params with a 400)."""
    import asyncio

    from pdpool.router.endpoints import Pool
    from pdpool.router.prefix_index import ApproxIndex, PrefixIndex
    from pdpool.router.scheduler import Scheduler
    from pdpool.router.settings import SchedulerProfile
    from pdpool.router.scorers import PrefixCacheScorer

    pool = Pool()
    prefill = [Endpoint(f"prefill-{i}", f"http://p{i}", "prefill", pdpool=True) for i in range(2)]
    decode = Endpoint("decode-0", "http://d0", "decode", pdpool=True)
    pool.replace("static", [*prefill, decode])
    index = PrefixIndex(None, ApproxIndex(1000), run_sync=None)
    scheduler = Scheduler(pool, index, InflightTracker(), SchedulerProfile([], [(PrefixCacheScorer(), 1.0)],
                                                                          MaxScorePicker()),
                          model_id="demo", dtype="float32", block_size=16, disagg_min_tokens=32)

    def plan():
        return asyncio.run(scheduler.plan(1000, lambda fp: [], disaggregable=True))

    normal = plan()
    assert normal.decode[0].node_id == "decode-0" and normal.prefill is not None
    pool.cool_down("decode-0", 60)        # the only decode node restarts
    stand_in = plan()
    assert stand_in.decode[0].role == "prefill" and stand_in.prefill is None


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.booleans()), max_size=40))
def test_a_node_that_leaves_takes_its_cooldown_with_it(events):
    """Node ids change at every rollout: the cooldowns of nodes that failed and then left piled up for the life of
    the router. Whatever nodes fail and leave, the cooldowns held are only those of nodes still in the pool."""
    from pdpool.router.endpoints import Pool

    pool = Pool(cooldown_seconds=60)
    present: set[str] = set()
    for node_id, fails in events:
        if fails:
            present.add(node_id)
            pool.replace("test", [make_endpoint(n) for n in sorted(present)])
            pool.cool_down(node_id)
        else:
            present.discard(node_id)
            pool.replace("test", [make_endpoint(n) for n in sorted(present)])
        assert set(pool._cooldown_until) <= present
