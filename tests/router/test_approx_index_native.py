"""The approximate index in C (``ApproxTable`` of ``pdpool/csrc/pieces.c``) against the Python one
(``router/prefix_index.py``'s ``PyApproxIndex``): the same answers for any sequence of calls, LRU order and
evictions included; clear errors for what only the Python class takes; no leaked references or memory."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from hypothesis_profiles import scaled
from pdpool.block_hash import HASH_BYTES
from pdpool.router.prefix_index import ApproxIndex, PyApproxIndex
from test_router_units import PATHS, _chained_hashes


@pytest.fixture(scope="module")
def table_type():
    """CI and the image have a C compiler and Python's headers: the C table must be there, not a silent
    fallback."""
    from pdpool import native_text

    module = native_text.load()
    assert module is not None
    return module.ApproxTable


def test_the_c_table_is_chosen_where_the_native_module_loads(table_type):
    assert type(ApproxIndex(10)) is table_type


def test_the_python_index_is_chosen_without_the_native_module(monkeypatch):
    from pdpool import native_text

    monkeypatch.setattr(native_text, "_loaded", [None])   # as load() leaves it where the module cannot be built
    assert type(ApproxIndex(10)) is PyApproxIndex
    code = ("from pdpool.router.prefix_index import ApproxIndex, PyApproxIndex; "
            "assert type(ApproxIndex(10)) is PyApproxIndex")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PDPOOL_ROUTER_NATIVE": "0"})


# ---- the same answers ------------------------------------------------------------------------------------------

NODES = ["node-a", "node-b", "node-c"]


def _fresh(s: str) -> str:
    """An equal str that is another object: ids compare as values, not identities."""
    return "".join(list(s))


# Incarnations: a node's current one (usually), a restart (the next), or another value (None, a str)
inc_choices = st.sampled_from(["current", "current", "current", "restart", None, "i0"])
steps = st.integers(0, 2)                                 # the clock's advance at a record (0: the same time)
pool_hashes = st.lists(st.integers(0, 15), max_size=10)   # any sequence: duplicates, any order
record_op = st.tuples(st.just("record"), st.one_of(st.tuples(st.integers(0, 3), st.integers(0, 8)), pool_hashes),
                      st.sampled_from(NODES), inc_choices, steps)
lookup_op = st.tuples(st.just("lookup"), st.one_of(st.just("last"), st.integers(0, 3), pool_hashes),
                      st.dictionaries(st.sampled_from([*NODES, "node-x"]),
                                      st.sampled_from(["current", "current", "current", "stale", None, "i0"]),
                                      min_size=1, max_size=5),
                      st.one_of(st.none(), st.integers(0, 4), st.just(float("inf")), st.just(0.5)))   # how far back
owner_op = st.tuples(st.just("owner"), st.integers(0, 40), st.sampled_from([*NODES, "node-x"]))
ops = st.lists(st.one_of(record_op, lookup_op, owner_op), min_size=2, max_size=40)


@settings(max_examples=scaled(300), deadline=None)
@given(ops=ops, capacity=st.one_of(st.integers(0, 12), st.integers(13, 40), st.just(10_000)))
def test_the_c_table_answers_as_the_python_index(table_type, ops, capacity):
    hashes_of = _chained_hashes()
    pool = [bytes([200 + i]) * HASH_BYTES for i in range(16)]

    def hashes(spec):
        if isinstance(spec, tuple):      # a prompt: a prefix of a path of chained hashes
            return hashes_of(PATHS[spec[0]][:spec[1]])
        if isinstance(spec, int):        # a whole path
            return hashes_of(PATHS[spec])
        if spec == "last":               # the last prompt recorded, and a block more
            return [*last, pool[15]]
        return [pool[i] for i in spec]

    c, py = table_type(capacity), PyApproxIndex(capacity)
    seen: list[bytes] = []
    last: list[bytes] = []
    current = {n: 0 for n in [*NODES, "node-x"]}
    clock = 0.0
    for op in ops:
        if op[0] == "record":
            _, spec, node, choice, step = op
            if choice == "restart":
                current[node] = current[node] + 1 if type(current[node]) is int else 0
            elif choice != "current":
                current[node] = choice
            inc = current[node]
            clock += step
            hs = last = hashes(spec)
            seen.extend(hs)
            c.record(hs, _fresh(node), inc, now=clock)
            py.record(hs, node, inc, now=clock)
            assert c.keys() == py.keys()            # the same hashes, in the same LRU order
            assert len(c) == len(py) <= capacity
        elif op[0] == "lookup":
            _, spec, wanted, back = op
            incs = {n: current[n] if w == "current" else (current[n] - 1 if w == "stale" and type(current[n]) is int
                                                          else w)
                    for n, w in wanted.items()}
            since = None if back is None else clock - back   # often exactly a recorded time
            hs = hashes(spec)
            got = c.lookup(hs, {_fresh(n): i for n, i in incs.items()}, since=since)
            assert got == py.lookup(hs, incs, since=since)
            assert list(got) == list(incs)          # the nodes in the order asked
        else:
            _, k, node = op
            h = seen[k % len(seen)] if seen else pool[0]
            assert c.owner(h, node) == py.owner(h, node)
    for h in seen:
        for node in NODES:
            assert c.owner(h, node) == py.owner(h, node)


def test_the_least_recently_recorded_hash_goes_first(table_type):
    hs = [bytes([i]) * 16 for i in range(6)]
    for idx in (table_type(3), PyApproxIndex(3)):
        idx.record(hs[:3], "a", None, now=1.0)
        idx.record([hs[0]], "b", None, now=2.0)    # held: moved to the most recent end, owned by both
        idx.record([hs[3], hs[4]], "a", None, now=3.0)
        assert idx.keys() == [hs[0], hs[3], hs[4]]
        assert idx.owner(hs[0], "a") == (None, 1.0) and idx.owner(hs[0], "b") == (None, 2.0)
        assert idx.owner(hs[1], "a") is None
        assert idx.lookup(hs, {"a": None, "b": None}) == {"a": 5, "b": 1}
        assert idx.lookup(hs, {"a": None, "b": None}, since=2.5) == {"a": 5, "b": 0}


def test_a_zero_capacity_holds_nothing(table_type):
    for idx in (table_type(0), PyApproxIndex(0)):
        idx.record([b"x" * 16], "a", None)
        assert len(idx) == 0 and idx.keys() == [] and idx.lookup([b"x" * 16], {"a": None}) == {"a": 0}


def test_the_router_keyword_arguments_and_defaults(table_type):
    t = table_type(capacity=4)
    assert t.capacity == 4
    t.record(hashes=[b"x" * 16], node_id="a", incarnation="i")   # now: time.monotonic()
    import time

    (inc, recorded) = t.owner(b"x" * 16, "a")
    assert inc == "i" and abs(recorded - time.monotonic()) < 60
    assert t.lookup(hashes=(b"x" * 16,), incarnations={"a": "i"}, since=None) == {"a": 1}
    assert t.lookup([b"x" * 16], {"a": "i"}, since=recorded + 1) == {"a": 0}


# ---- bad input --------------------------------------------------------------------------------------------------

def test_block_hashes_must_be_16_bytes(table_type):
    t = table_type(10)
    good = b"g" * HASH_BYTES
    with pytest.raises(TypeError, match="block hash 1 is str, not bytes"):
        t.record([good, "x" * 16], "a", None)
    with pytest.raises(ValueError, match="block hash 2 has 15 bytes, not 16"):
        t.record([good, good, b"x" * 15], "a", None)
    assert len(t) == 0                                  # checked before anything is recorded
    with pytest.raises(ValueError, match="has 17 bytes"):
        t.lookup([b"x" * 17], {"a": None})
    with pytest.raises(TypeError, match="not bytes"):
        t.lookup([bytearray(16)], {"a": None})
    with pytest.raises(TypeError, match="not bytes"):
        t.owner(None, "a")
    with pytest.raises(ValueError, match="not 16"):
        t.owner(b"", "a")
    with pytest.raises(TypeError, match="sequence"):
        t.record(5, "a", None)


def test_other_bad_arguments(table_type):
    t = table_type(10)
    with pytest.raises(ValueError, match="capacity"):
        table_type(-1)
    with pytest.raises(TypeError, match="now must be a number"):
        t.record([b"x" * 16], "a", None, now="soon")
    with pytest.raises(TypeError, match="since must be a number"):
        t.lookup([b"x" * 16], {"a": None}, since="then")
    with pytest.raises(TypeError, match="unhashable"):
        t.record([b"x" * 16], ["a"], None)
    with pytest.raises(TypeError, match="unhashable"):
        t.record([b"x" * 16], "a", {})
    with pytest.raises(TypeError, match="unexpected keyword"):
        t.record([b"x" * 16], "a", None, when=1.0)
    with pytest.raises(TypeError, match="missing required argument 'incarnation'"):
        t.record([b"x" * 16], "a")
    assert len(t) == 0 and t.lookup([b"x" * 16], {"a": None}) == {"a": 0}


def test_a_node_id_that_calls_back_into_the_table_is_refused(table_type):
    t = table_type(10)

    armed = []

    class Sneaky(str):
        def __hash__(self):
            if armed:
                t.record([b"y" * 16], "b", None)
            return str.__hash__(self)

    t.record([b"x" * 16], "a", None, now=1.0)
    incarnations = {Sneaky("a"): None}
    armed.append(True)
    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        t.lookup([b"x" * 16], incarnations)
    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        t.record([b"z" * 16], Sneaky("a"), None)
    assert t.keys() == [b"x" * 16] and t.lookup([b"x" * 16], {"a": None}) == {"a": 1}


# ---- memory -------------------------------------------------------------------------------------------------------

def test_references_are_released_by_eviction_and_deallocation(table_type):
    node, inc, old_inc = _fresh("node-refcount"), _fresh("inc-new"), _fresh("inc-old")
    base = [sys.getrefcount(o) for o in (node, inc, old_inc)]
    t = table_type(4)
    t.record([bytes([i]) * 16 for i in range(4)], node, old_inc)
    t.record([bytes([i]) * 16 for i in range(2)], node, inc)       # two entries change incarnation
    t.record([bytes([i]) * 16 for i in range(10, 14)], "other", None)   # all of node's entries evicted
    assert [sys.getrefcount(o) for o in (node, inc, old_inc)] == base
    t.record([bytes([i]) * 16 for i in range(2)], node, inc)
    t.record([bytes([i]) * 16 for i in range(2)], "other", old_inc)
    del t
    gc.collect()
    assert [sys.getrefcount(o) for o in (node, inc, old_inc)] == base


def test_memory_stays_flat_while_millions_of_hashes_pass_through(table_type):
    """A small table, every record call fresh hashes under a fresh incarnation (a restart each time), several
    owners per hash: after the first rounds, nothing grows."""
    t = table_type(1000)
    batch = 64

    def rounds(start: int, count: int) -> None:
        for r in range(start, start + count):
            hs = [(r * batch + i).to_bytes(16, "little") for i in range(batch)]
            t.record(hs, f"node-{r % 3}", f"inc-{r}")
            t.record(hs[: batch // 2], f"node-{(r + 1) % 3}", f"inc-{r}")
            t.lookup(hs, {"node-0": f"inc-{r}", "node-1": None})

    rounds(0, 200)
    tracemalloc.start()
    try:
        rounds(200, 2000)
        before = tracemalloc.get_traced_memory()[0]
        rounds(2200, 14000)          # about 1.3 million hashes recorded
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(t) == 1000
    assert after - before < 64 * 1024, (before, after)
