"""What the CRD schema cannot catch becomes a SpecError with a clear message."""

from __future__ import annotations

import pytest

from operator_examples import make_body
from pdpool.operator.spec import SpecError, parse_pool


def test_empty_spec_is_the_cpu_demo_with_schema_defaults():
    pool = parse_pool(make_body({}))
    assert (pool.node.model.model, pool.node.device.device, pool.image) == ("demo", "cpu", "ghcr.io/pdpool/pdpool:0.1.0")
    assert pool.managed_redis and pool.redis_url == "redis://p-redis.default.svc:6379/0"
    # unset replicas are an autoscaler's, the router's too (its CRD default of 1 made the operator fight an HPA)
    assert pool.roles["router"].replicas is None and pool.roles["decode"].replicas is None


@pytest.mark.parametrize("spec, message", [
    ({"engine": {"device": "cuda"}}, "engine.device is cuda but prefill.resources.limits has no nvidia.com/gpu"),
    ({"model": {"name": "/models/x", "source": {"pvc": {"claimName": "a"}, "hostPath": {"path": "/b"}}}},
     "model.source: set one of pvc, hostPath"),
    ({"model": {"name": "/data/x", "source": {"pvc": {"claimName": "a"}}}}, "must be a path under model.mountPath"),
    ({"redis": {"passwordSecretRef": {"name": "s"}}}, "redis.passwordSecretRef needs redis.url"),
    ({"engine": {"maxNumSeqs": 0}}, "--max-num-seqs: 0 is below the minimum 1"),
])
def test_specs_the_schema_cannot_reject(spec, message):
    with pytest.raises(SpecError, match=message):
        parse_pool(make_body(spec))


@pytest.mark.parametrize("gpus, refused", [(0, True), ("0", True), ("0m", True), ("0.0", True), (1, False),
                                           ("1", False), ("2", False)])
def test_a_cuda_pool_needs_a_gpu_however_the_count_is_written(gpus, refused):
    """``nvidia.com/gpu: "0"`` (a string, as the API server stores quantities) was taken for a GPU."""
    limits = {"resources": {"limits": {"nvidia.com/gpu": gpus}}}
    body = make_body({"engine": {"device": "cuda"}, "prefill": limits, "decode": limits})
    if refused:
        with pytest.raises(SpecError, match="has no nvidia.com/gpu"):
            parse_pool(body)
    else:
        parse_pool(body)
