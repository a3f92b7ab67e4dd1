"""An InferencePool YAML → the local processes ``pdpool up`` runs, through the operator's own parsing.

The file is checked against the CRD's schema (``operator.crd``) as the API server would, then parsed by
``operator.spec.parse_pool``; each node's flags come from ``operator.builders.nodes.node_config`` and the router's
from ``operator.builders.router.router_config``, with only what differs on one machine replaced: loopback
addresses, local ports, the local Redis, a node id per process. So the same file means the same pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from pdpool import config
from pdpool.operator import crd, schema
from pdpool.operator.builders import config_map
from pdpool.operator.builders.nodes import node_config
from pdpool.operator.builders.router import router_config
from pdpool.operator.spec import NODE_ROLES, Pool, SpecError, parse_pool
from pdpool.utils import http_url

# With no file: the demo model, 1 prefill + 1 decode node on CPU, a managed Redis (examples/cpu-demo.yaml, minus
# its Kubernetes resources).
DEFAULT_POOL = {
    "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "demo"},
    "spec": {"model": {"name": "demo"}, "engine": {"device": "cpu", "maxNumSeqs": 8, "maxNumBatchedTokens": 512},
             "prefill": {"replicas": 1}, "decode": {"replicas": 1},
             "kvTransfer": {"ucxTls": "tcp,self", "leaseSeconds": 10}},
}

# Deployment-only fields that still mean something on one machine.
LOCAL_FIELDS = {"prefill.replicas", "decode.replicas", "prefill.env", "decode.env"}
CPU_UCX_TLS = "tcp,self"


# Node flags that `up` gives each process itself: after -- they would break its wiring (every node on one port, or
# of one role; a token the nodes hold and the router does not). {flag: why}
WIRED_FLAGS = {flag: "pdpool up sets it for each process" for flag in (
    "--host", "--port", "--role", "--node-id", "--advertise-host", "--redis", "--pool", "--namespace")}
WIRED_FLAGS.update({"--config": "its settings would reach the nodes and not the router (a served name, a block size); "
                                "give them as flags after -- instead",
                    "--internal-token": "pdpool up makes one for the router and the nodes",
                    "--internal-token-file": "pdpool up makes one for the router and the nodes"})


class PoolFileError(ValueError):
    """The file is not an InferencePool the operator would accept."""


class FlagError(Exception):
    pass


class FlagParser(argparse.ArgumentParser):
    """Raises ``FlagError`` where argparse would print and exit."""

    def error(self, message: str):
        raise FlagError(message)


def extra_settings(extra_flags: Sequence[str]) -> dict[str, Any]:
    """{flag: value} of the node settings that flags after -- give (a secret's ``--X-file`` as itself); {} where
    they do not parse (``check_serve_flags`` says why before anything starts)."""
    parser = FlagParser(add_help=False)
    config.add_arguments(parser)
    try:
        given, _ = parser.parse_known_args(list(extra_flags))
    except FlagError:
        return {}
    fields = {f"{sec}.{f.name}": f for sec, f in config.all_options(config.NodeConfig)}
    out = {}
    for dest, value in vars(given).items():
        name, _, file = dest.partition("__")
        out[config.flag_name(fields[name]) + ("-file" if file else "")] = value
    return out


def refused_extra_flag(extra_flags: Sequence[str]) -> str | None:
    """Why a flag after -- cannot go to the nodes (None: every one can)."""
    secrets = {config.flag_name(f): f for _, f in config.all_options(config.NodeConfig) if f.metadata.get("secret")}
    for flag in extra_settings(extra_flags):
        if flag in WIRED_FLAGS:
            return f"{flag} after --: {WIRED_FLAGS[flag]}"
        secret = secrets.get(flag.removesuffix("-file"))
        if secret is not None:
            return (f"{flag} after --: set {config.env_name(secret)} in pdpool up's environment instead (the router "
                    "and the nodes read it there)")
    return None


def router_overrides(extra_flags: Sequence[str]) -> dict[str, Any]:
    """The router's settings that flags after -- give the nodes: the model, its served name, the block-hash
    fingerprint's dtype and block size, the chat template and tool-call settings, CORS. The router must share
    them, as the operator gives it the pool's (one served name: the nodes' first)."""
    node_fields = {config.flag_name(f): f for _, f in config.all_options(config.NodeConfig)}
    router_fields = {config.flag_name(f): f for _, f in config.all_options(config.RouterCommandConfig)}
    out = {}
    for flag, value in extra_settings(extra_flags).items():
        f = router_fields.get(flag)
        if f is None or flag in WIRED_FLAGS or f.metadata.get("secret"):
            continue
        if isinstance(value, list) and config.several(node_fields[flag]) and not config.several(f):
            value = value[0]
        out[f.name] = value
    return out


@dataclass
class ProcessSpec:
    """One child: ``pdpool <argv>`` on ``port`` with ``env`` added to the environment."""
    name: str                     # prefill-0, decode-0, router-0: its log prefix and (for nodes) its node id
    role: str                     # prefill | decode | router
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"       # where to reach it

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def ignored_fields(spec: dict) -> list[str]:
    """The Kubernetes-only fields set in ``spec`` (before defaults), which a local pool ignores."""
    out = []
    for path in schema.DEPLOYMENT_FIELDS:
        if path in LOCAL_FIELDS:
            continue
        node = spec
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out.append(path)
    for role in NODE_ROLES:
        env = (spec.get(role) or {}).get("env") or []
        out += [f"{role}.env[{e['name']}].valueFrom" for e in env if "valueFrom" in e]
    return out


def load_pool(path: str | Path | None) -> tuple[Pool, list[str]]:
    """(the parsed pool, the Kubernetes-only fields it sets); ``None`` is the built-in example."""
    where = "the built-in example" if path is None else str(path)
    try:
        docs = [DEFAULT_POOL] if path is None else list(yaml.safe_load_all(Path(path).read_text()))
    except yaml.YAMLError as exc:  # its message spans lines (the offending line, a caret): keep the first
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise PoolFileError(f"{where}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    body, others = _the_pool(docs, where)
    if not isinstance(body, dict):
        raise PoolFileError(f"{where}: not a YAML mapping")
    if (body.get("apiVersion"), body.get("kind")) != (crd.API_VERSION, crd.KIND):
        raise PoolFileError(f"{where}: expected apiVersion {crd.API_VERSION} and kind {crd.KIND}, got "
                            f"{body.get('apiVersion')} and {body.get('kind')}")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise PoolFileError(f"{where}: metadata: expected object, got {metadata!r}")
    name = (metadata or {}).get("name")
    if not name:
        raise PoolFileError(f"{where}: metadata.name is required (the pool's name)")
    # what the CRD's metadata.name restriction makes the API server refuse: the same file means the same pool
    if not isinstance(name, str) or len(name) > crd.MAX_POOL_NAME or not re.match(crd.POOL_NAME_PATTERN, name):
        raise PoolFileError(f"{where}: metadata.name {name!r} must be a DNS-1035 label of at most "
                            f"{crd.MAX_POOL_NAME} characters (lowercase letters, digits and '-', a letter first)")
    if body.get("spec") is None:  # the CRD requires it; the API server prunes a null one, then refuses the object
        raise PoolFileError(f"{where}: spec is required (an empty pool is spec: {{}})")
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    errors = crd.schema_errors(body["spec"], root, "spec")
    if errors:
        raise PoolFileError(f"{where}: " + "; ".join(errors))
    try:
        pool = parse_pool(body)
    except SpecError as exc:
        raise PoolFileError(f"{where}: {exc}") from None
    return pool, ignored_fields(body.get("spec") or {}) + others


def _the_pool(docs: list, where: str) -> tuple[object, list[str]]:
    """(the file's one InferencePool, the other objects as Kind/name): a file `kubectl apply -f` takes may hold
    empty documents (a leading or trailing ---) and other objects (the pool's Secret). One document is the pool
    whatever it is (its own checks follow)."""
    docs = [d for d in docs if d is not None]
    if len(docs) == 1:
        return docs[0], []
    def is_pool(d) -> bool:
        return isinstance(d, dict) and d.get("kind") == crd.KIND

    def named(d) -> str:
        meta = d.get("metadata") if isinstance(d, dict) else None
        kind = d.get("kind") if isinstance(d, dict) else None
        return f"{kind or '?'}/{meta.get('name') if isinstance(meta, dict) else '?'}"

    pools, others = [d for d in docs if is_pool(d)], [named(d) for d in docs if not is_pool(d)]
    if len(pools) != 1:
        found = f"{len(pools)} InferencePools ({', '.join(named(d).split('/', 1)[1] for d in pools)}); give a " \
                "file with one" if pools else "no InferencePool" + (f" ({', '.join(others)})" if others else "")
        raise PoolFileError(f"{where}: {found}")
    return pools[0], others


def replicas(pool: Pool, role: str) -> int:
    """Unset (an autoscaler's on Kubernetes) is one process locally."""
    n = pool.roles[role].replicas
    return 1 if n is None else n


def shared_env(pool: Pool, redis_password: str | None, internal_token: str) -> dict[str, str]:
    """The pool's ConfigMap, plus the secrets the operator passes through Secrets (never argv)."""
    env = dict(config_map(pool)["data"])
    if pool.node.device.device == "cpu" and not pool.node.disagg.ucx_tls:
        env["UCX_TLS"] = CPU_UCX_TLS
    env.update(PDPOOL_INTERNAL_TOKEN=internal_token, TOKENIZERS_PARALLELISM="false")
    if redis_password:
        env["PDPOOL_REDIS_PASSWORD"] = redis_password
    return env


def node_spec(pool: Pool, role: str, index: int, port: int, redis_url: str, extra_flags: list[str]) -> ProcessSpec:
    name = f"{role}-{index}"
    cfg = node_config(pool, role)
    cpu = cfg.device.device == "cpu"
    cfg = dataclasses.replace(
        cfg,
        server=dataclasses.replace(cfg.server, host="127.0.0.1", port=port),
        device=dataclasses.replace(cfg.device, num_threads=cfg.device.num_threads or (1 if cpu else None)),
        disagg=dataclasses.replace(cfg.disagg, redis=redis_url, advertise_host=None, node_id=name,
                                   ucx_tls=cfg.disagg.ucx_tls or (CPU_UCX_TLS if cpu else None)))
    env = {e["name"]: str(e.get("value", "")) for e in pool.roles[role].env if "valueFrom" not in e}
    return ProcessSpec(name, role, port, ["serve", *config.to_argv(cfg), *extra_flags], env)


def local_router_config(pool: Pool, extra_node_flags: Sequence[str] = ()) -> config.RouterCommandConfig:
    """The operator's router settings for ``pool``, with those the nodes' flags after -- change."""
    cfg = router_config(pool)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, **router_overrides(extra_node_flags)))


def router_spec(pool: Pool, host: str, port: int, redis_url: str,
                extra_node_flags: Sequence[str] = ()) -> ProcessSpec:
    cfg = local_router_config(pool, extra_node_flags)
    # router.discovery is Kubernetes-only (listed as ignored): a local router finds the nodes by their heartbeats.
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, redis=redis_url, host=host, port=port,
                                                              kubernetes=False))
    return ProcessSpec("router-0", "router", port, ["router", *config.to_argv(cfg, config.RouterCommandConfig)],
                       host=connect_host(host))


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def plan(pool: Pool, *, redis_url: str, router_host: str, router_port: int, node_port: Callable[[], int],
         extra_node_flags: Sequence[str] = ()) -> list[ProcessSpec]:
    """Every child, nodes first; ``node_port()`` gives each node its port."""
    nodes = [node_spec(pool, role, i, node_port(), redis_url, list(extra_node_flags))
             for role in NODE_ROLES for i in range(replicas(pool, role))]
    return [*nodes, router_spec(pool, router_host, router_port, redis_url, extra_node_flags)]
