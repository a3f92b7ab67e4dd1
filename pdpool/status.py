"""``pdpool status [--url URL]``: a pool as ``kubectl get`` would print it.

    NAME        ROLE     STATE    RUNNING  WAITING  KV-USAGE  PREFIX-HIT  RESTARTS  URL
    prefill-0   prefill  ready    0        0        3.1%      42.0%       0         http://127.0.0.1:40111

    ROUTER      DISAGGREGATED  DECODE-ONLY  FALLBACK  RETRY  NODES
    router-0    12             3            0         0      prefill 1/1, decode 1/1

Nodes come from their Redis heartbeats (load, KV usage, prefix-cache counters), joined with the processes of a
``pdpool up`` (its state file: ``pdpool.up.state``); the route decisions from the router's ``/metrics``. Without
flags it shows every running ``pdpool up``; ``--url`` picks one by its router, or reads any router (with
``--redis``/``--pool`` for the nodes, the password from ``PDPOOL_REDIS_PASSWORD``).
"""

from __future__ import annotations

import argparse
import os
import sys

from pdpool.node_process import http_get, parse_metrics

DECISIONS = ("disaggregated", "decode_only", "fallback", "retry")


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def heartbeats(redis_url: str, password: str | None, namespace: str, pool: str) -> dict:
    from pdpool.kv_index.keys import PoolKeys
    from pdpool.kv_index.redis_index import IndexReader, connect

    client = connect(redis_url, password, timeout=2.0)
    try:
        return IndexReader(client, PoolKeys(namespace, pool)).live_nodes()
    finally:
        client.close()


def node_rows(processes: list[dict], live: dict) -> list[list[str]]:
    rows = [["NAME", "ROLE", "STATE", "RUNNING", "WAITING", "KV-USAGE", "PREFIX-HIT", "RESTARTS", "URL"]]
    known = [p for p in processes if p["role"] != "router"]
    names = [p["name"] for p in known] + sorted(set(live) - {p["name"] for p in known})
    by_name = {p["name"]: p for p in known}
    for name in names:
        proc, hb = by_name.get(name, {}), live.get(name)
        state = proc.get("state", "ready")
        if hb is not None and hb.draining:
            state = "draining"
        elif hb is None and state == "ready":
            state = "ready (no heartbeat)"
        if hb is None:
            load = ["-", "-", "-", "-"]
        else:
            hit = (hb.prefix_cache_hit_tokens / hb.prefix_cache_queried_tokens
                   if hb.prefix_cache_queried_tokens else None)
            load = [str(hb.load.num_running), str(hb.load.num_waiting), _pct(hb.load.kv_usage), _pct(hit)]
        rows.append([name, proc.get("role") or (hb.role if hb else "-"), state, *load,
                     str(proc.get("restarts", "-")), proc.get("url") or (hb.url if hb else "-")])
    return rows


def router_rows(router_url: str, name: str = "router-0") -> list[list[str]]:
    head = ["ROUTER", *(d.upper().replace("_", "-") for d in DECISIONS), "NODES"]
    try:
        status, body = http_get(router_url.rstrip("/") + "/metrics", timeout=5)
    except OSError as exc:
        return [head, [name, *("-" for _ in DECISIONS), f"unreachable: {exc}"]]
    if status != 200:
        return [head, [name, *("-" for _ in DECISIONS), f"/metrics answered {status}"]]
    m = parse_metrics(body.decode())
    counts = [str(int(m.get(f'pdpool_router_requests_total{{decision="{d}"}}', 0))) for d in DECISIONS]
    nodes = []
    for role in ("prefill", "decode", "both"):
        usable = int(m.get(f'pdpool_router_nodes{{role="{role}",usable="true"}}', 0))
        total = usable + int(m.get(f'pdpool_router_nodes{{role="{role}",usable="false"}}', 0))
        if total:
            nodes.append(f"{role} {usable}/{total}")
    return [head, [name, *counts, ", ".join(nodes) or "none"]]


def show(router_url: str, *, pool: str | None, namespace: str, redis_url: str | None, password: str | None,
         processes: list[dict], title: str) -> str:
    lines = [title]
    live: dict = {}
    if redis_url and pool:
        try:
            live = heartbeats(redis_url, password, namespace, pool)
        except Exception as exc:  # noqa: BLE001 (the router's part is still worth printing)
            lines.append(f"(cannot read heartbeats from {redis_url}: {exc})")
    if processes or live:
        lines += [table(node_rows(processes, live)), ""]
    else:
        lines += ["(no node details: give --redis URL --pool NAME, or run where `pdpool up` runs)", ""]
    lines.append(table(router_rows(router_url)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdpool status", description="Show a pool: nodes, load, route decisions.")
    parser.add_argument("--url", help="the router's URL (default: every `pdpool up` running on this machine)")
    parser.add_argument("--redis", help="the pool's Redis URL, for node details when --url is not a `pdpool up`")
    parser.add_argument("--pool", help="the pool's name (with --redis)")
    parser.add_argument("--namespace", default="default", help="the pool's namespace (with --redis)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from pdpool.up import state

    ups = state.running()
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
        url = url if "://" in url else f"http://{url}"  # localhost:8000, as curl takes it
        ups = [s for s in ups if s["router_url"] == url or url.endswith(":" + s["router_url"].rsplit(":", 1)[1])]
        if not ups:
            try:
                http_get(url + "/metrics", timeout=5)
            except (OSError, ValueError) as exc:  # nothing of the pool to show: an error, not an empty table
                print(f"pdpool status: no router answers at {url} ({getattr(exc, 'reason', exc)}) and no "
                      "`pdpool up` here runs it", file=sys.stderr)
                return 1
            print(show(url, pool=args.pool, namespace=args.namespace, redis_url=args.redis,
                       password=os.environ.get("PDPOOL_REDIS_PASSWORD"), processes=[], title=f"ROUTER {url}"))
            return 0
    if not ups:
        print("pdpool status: no `pdpool up` is running here; give --url (and --redis/--pool for node details)",
              file=sys.stderr)
        return 1
    for i, s in enumerate(ups):
        title = (f"POOL {s['pool']}  MODEL {s['model']}  ROUTER {s['router_url']}/v1  "
                 f"({'ready' if s['ready'] else 'starting'}; pdpool up pid {s['pid']})")
        print(("\n" if i else "") + show(s["router_url"], pool=s["pool"], namespace=s["namespace"],
                                        redis_url=s["redis_url"], password=s["redis_password"],
                                        processes=s["processes"], title=title))
    return 0
