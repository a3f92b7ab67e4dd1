"""A prefill request aborted after it finished (lease issued) but before its output reached the client frees its
lease at once. The race: the client (the router) disconnects while the engine runs the prefill's last step; the
stream's abort reaches the engine after the step finished the request, and the output with the KV handle is
dropped (no stream), so nothing would ever notify the lease: its blocks stayed held until expiry.
A real engine on the demo model, with the real prefill side in its connector."""

from __future__ import annotations

from pdpool import config
from pdpool.engine.kv_connector import KVConnector, kv_fingerprint
from pdpool.engine.llm_engine import LLMEngine
from pdpool.engine.sampling_params import SamplingParams
from pdpool.kv_metrics import KVMetrics
from pdpool.kv_transfer.layout import region_of
from pdpool.prefill_node.side import NodeIdentity, PrefillSide


def prefill_engine() -> tuple[LLMEngine, list[PrefillSide]]:
    sides: list[PrefillSide] = []

    def connector(engine):
        identity = NodeIdentity("p0", "inc", "p0#inc", "127.0.0.1", 1)
        sides.append(PrefillSide(engine, identity, kv_fingerprint(engine), [region_of(engine.runner.kv_cache)],
                                 lease_seconds=60.0, max_leased_blocks=None, transfer_mode="pull",
                                 metrics=KVMetrics()))
        return KVConnector(engine.kv_cache_manager, sides)

    cfg = config.build(model="demo", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    return LLMEngine(cfg, connector_factory=connector), sides


def run_to_finish(engine: LLMEngine, request_id: str):
    for _ in range(50):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError("the prefill did not finish")


def test_abort_after_finish_releases_the_undelivered_lease(demo_model_dir):
    engine, (side,) = prefill_engine()
    pool = engine.kv_cache_manager.pool
    idle_free = pool.num_free_blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)

    engine.add_request("delivered", list(range(100, 180)), params, kv_transfer_params={"do_remote_decode": True})
    lease_id = run_to_finish(engine, "delivered").kv_transfer_params["lease_id"]
    assert side.table.num_leased_blocks > 0 and pool.num_free_blocks < idle_free
    assert side.notify(lease_id)                      # the decode node's notification: the normal end
    assert side.table.num_leased_blocks == 0 and pool.num_free_blocks == idle_free

    engine.add_request("undelivered", list(range(200, 280)), params, kv_transfer_params={"do_remote_decode": True})
    assert run_to_finish(engine, "undelivered").kv_transfer_params["lease_id"]
    engine.abort_request("undelivered")               # the stream's abort, queued behind the step that finished it
    assert len(side.table.leases) == 0 and side.table.num_leased_blocks == 0   # before the fix: held until expiry
    assert pool.num_free_blocks == idle_free

    engine.abort_request("undelivered")               # a repeated abort, or one of an unknown id: nothing to free
    engine.abort_request("unknown")
    assert pool.num_free_blocks == idle_free


def test_release_by_response_id_frees_that_responses_leases_only(demo_model_dir):
    """The router's client left as the prefill answer went out (written, never read): the router has the node free
    the leases of that response (``X-Request-Id``; engine ids ``<id>-<8 hex>-<choice>``), and nothing else."""
    engine, (side,) = prefill_engine()
    pool = engine.kv_cache_manager.pool
    idle_free = pool.num_free_blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for rid, start in (("gone-1-0a1b2c3d-0", 100), ("gone-10-0a1b2c3d-0", 200)):
        engine.add_request(rid, list(range(start, start + 80)), params, kv_transfer_params={"do_remote_decode": True})
        assert run_to_finish(engine, rid).kv_transfer_params["lease_id"]
    kept = side.table.lease_of("gone-10-0a1b2c3d-0")
    assert side.release_response("gone-1") == 1
    assert list(side.table.leases) == [kept] and pool.num_free_blocks < idle_free
    assert side.release_response("gone-1") == 0 and side.release_response("unknown") == 0
    assert side.release_response("gone-10") == 1
    assert side.table.num_leased_blocks == 0 and pool.num_free_blocks == idle_free
