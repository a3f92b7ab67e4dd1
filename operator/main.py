"""``pdpool operator [--namespace NS] …``: kopf behind a Lease elector. ``pdpool operator crd`` prints the CRD.

kopf's cluster scanning is off: it would list and watch ``namespaces`` and ``customresourcedefinitions``, two
cluster-scoped resources, and a namespaced operator must not need a ClusterRole. So the namespaces are exactly
``--namespace``, and the CRD must be served before kopf starts: the operator waits for it (not ready meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import sys

import kopf
import yaml

from pdpool import logs
from pdpool.operator import crd
from pdpool.operator.handlers import Options, configure, register
from pdpool.operator.health import Health
from pdpool.operator.kube import ApiError, Kube, login
from pdpool.operator.leader import LeaseElector, default_identity

log = logging.getLogger("pdpool.operator")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdpool operator", description="Run the InferencePool operator. "
                                "`pdpool operator crd` prints the CustomResourceDefinition.")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="Namespace to watch (repeatable; default: every namespace).")
    p.add_argument("--status-interval", type=float, default=5.0, help="Seconds between status refreshes.")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                   help="Lead through a coordination.k8s.io Lease before reconciling.")
    p.add_argument("--lease-name", default="pdpool-operator",
                   help="Name of the Lease; operators that share it elect one leader (the chart: one per release).")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="Namespace of the Lease (default: $POD_NAMESPACE, else the first --namespace, else default).")
    p.add_argument("--lease-seconds", type=float, default=15.0, help="Lease duration.")
    p.add_argument("--identity", default=None, help="Holder identity (default: $POD_NAME or host_pid).")
    p.add_argument("--managed-redis-url", default=None,
                   help="Reach managed Redis at this URL ({name}, {namespace} filled in), e.g. when the operator "
                        "runs outside the cluster.")
    p.add_argument("--pool-defaults", default=None, metavar="FILE",
                   help="YAML partial InferencePool spec applied under every pool (a pool's own values win), e.g. "
                        "kvTransfer.ucxNetDevices, kvTransfer.rdma, placement; checked against the CRD schema.")
    p.add_argument("--health-port", type=int, default=0,
                   help="Serve /healthz, /readyz and /metrics on this port (0: off).")
    p.add_argument("--health-host", default="", help="Address of the health port (default: every address, IPv4 "
                   "and IPv6: a kubelet probes the pod's IP, which is IPv6 only in an IPv6 cluster).")
    p.add_argument("--crd-wait-seconds", type=float, default=10.0,
                   help="Seconds between checks that the InferencePool CRD is served, before kopf starts.")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


class _QuietTimers(logging.Filter):
    """kopf logs every successful handler run; a status timer would flood the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("Timer ") and record.getMessage().endswith(" succeeded."))


async def crd_served(kube: Kube) -> bool:
    """Discovery (a non-resource URL every authenticated user may read): is pdpool.io/v1alpha1 served?"""
    try:
        found = await kube._request("GET", f"/apis/{crd.GROUP}/{crd.VERSION}", fenced=False)
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.get("name") == crd.PLURAL for r in (found or {}).get("resources") or [])


async def wait_for_crd(kube: Kube, every: float) -> None:
    while True:
        try:
            if await crd_served(kube):
                return
            log.error(f"the CRD {crd.CRD_NAME} is not served; install it (docs/deploy.md: `helm upgrade` with "
                      f"crds.install=true, or `pdpool operator crd | kubectl apply --server-side -f -`)")
        except (ApiError, OSError, asyncio.TimeoutError) as exc:
            log.warning(f"checking for the CRD {crd.CRD_NAME}: {exc}")
        await asyncio.sleep(every)


def defaulted_paths(defaults: dict, node: dict, path: str) -> list[str]:
    """Leaves with a CRD default: the API server writes that default into every pool, which then wins."""
    out = []
    for name, value in defaults.items():
        sub = (node.get("properties") or {}).get(name) or {}
        if isinstance(value, dict) and sub.get("type") == "object" and "properties" in sub:
            out += defaulted_paths(value, sub, f"{path}.{name}")
        elif "default" in sub:
            out.append(f"{path}.{name}: has a CRD default ({sub['default']!r}), which the API server writes into "
                       "every pool, so a pool default would never apply; set it in the pools")
    return out


def load_pool_defaults(path: str | None) -> dict:
    if not path:
        return {}
    with open(path) as f:
        defaults = yaml.safe_load(f) or {}
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    errors = crd.schema_errors(defaults, root, "poolDefaults") + defaulted_paths(defaults, root, "poolDefaults")
    if errors:
        raise SystemExit(f"pdpool operator: --pool-defaults {path}: " + "; ".join(errors))
    return defaults


async def run(args: argparse.Namespace) -> int:
    health = Health(args.lease_seconds)
    if args.health_port:
        await health.start(args.health_host or None, args.health_port)
    connection = login()
    registry = kopf.OperatorRegistry()
    register(registry, Options(status_interval=args.status_interval, managed_redis_url=args.managed_redis_url,
                               pool_defaults=load_pool_defaults(args.pool_defaults)))
    settings = kopf.OperatorSettings()
    configure(settings)
    settings.scanning.disabled = True  # no namespaces/CRD watches: see the module docstring
    discovery = Kube(connection, user_agent="pdpool-operator/discovery")
    await wait_for_crd(discovery, args.crd_wait_seconds)
    await discovery.close()
    health.crd_served = True
    elector = None
    identity = args.identity or default_identity()
    if args.leader_election:
        ns = args.lease_namespace or (args.namespace[0] if args.namespace else "default")
        elector = LeaseElector(Kube(connection, user_agent=f"pdpool-operator/{identity}/lease"), ns,
                               args.lease_name, identity, args.lease_seconds)
        health.elector = elector
        identity = elector.identity
        log.info(f"{identity}: waiting for Lease {ns}/{args.lease_name}")
        await elector.acquire()
        log.info(f"{identity}: leading")
    kube = Kube(connection, user_agent=f"pdpool-operator/{identity}")
    if elector:
        kube.fence = elector.is_leader  # a leader that may have lost the Lease writes nothing
    stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(
        registry=registry, settings=settings, standalone=True, clusterwide=not args.namespace,
        namespaces=args.namespace, stop_flag=stop, memo=kopf.Memo(kube=kube, connection=connection,
                                                   locks=collections.defaultdict(asyncio.Lock), overridden=set())))
    health.kopf_task = operator
    holding = asyncio.create_task(elector.hold()) if elector else None
    done, _ = await asyncio.wait({t for t in (operator, holding) if t}, return_when=asyncio.FIRST_COMPLETED)
    if holding in done:
        # Lost the Lease: exit at once, as client-go's elector does; kopf's graceful stop would let queued
        # handlers run for seconds. The Deployment restarts this process as a candidate.
        logging.shutdown()
        os._exit(1)
    if holding:
        holding.cancel()
        await elector.release()
        await elector.kube.close()
    await kube.close()
    await health.stop()
    operator.result()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["crd"]:
        sys.stdout.write(crd.render_crd())
        return 0
    args = parser().parse_args(argv)
    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    logging.getLogger("kopf.objects").addFilter(_QuietTimers())
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
