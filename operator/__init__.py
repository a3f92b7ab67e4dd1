"""Kubernetes operator for the ``InferencePool`` resource (``inferencepools.pdpool.io``).

Import only as ``pdpool.operator``. Modules, one role each:

- ``schema``   deployment-only spec fields (replicas, resources, ...); the rest comes from ``pdpool.config``
- ``crd``      the CustomResourceDefinition, generated; ``crd.yaml`` is its committed rendering
- ``spec``     a pool's body → typed ``Pool`` (defaults applied, cross-field checks → ``SpecError``)
- ``builders`` pure functions: ``Pool`` → desired child objects
- ``reconcile`` desired vs actual by spec hash: create, patch only what changed, never touch the rest
- ``status``   pure: children → status (phase, conditions, replicas, endpoint)
- ``kube``     a small async Kubernetes REST client over kopf's credentials
- ``handlers`` thin kopf handlers; ``leader`` a Lease elector; ``main`` the ``pdpool operator`` command;
  ``health`` its /healthz, /readyz and /metrics
- ``redis_keys`` the finalizer's SCAN-by-prefix deletion; ``drain`` the nodes' preStop hook (no kopf: the base install's dependencies only)
"""
