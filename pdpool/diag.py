"""``pdpool diag kv``: prove that a KV transfer between two pods works before traffic does.

Two sides, each a real NIXL agent built by ``pdpool.kv_transfer`` (the code the nodes run), with a pattern buffer
in pdpool's block layout::

    serve side (a prefill pod)                        connect side (a decode pod)
    blocks [0, n)  pattern(seed)      --- READ --->   blocks [0, n)   (pull, as a decode node does)
    blocks [n, 2n) sink               <-- WRITE ---   blocks [n, 2n)  pattern(seed + 1)   (push)
                                      --- READ --->   read back [n, 2n) to check the WRITE landed
                                      <-- notif ---   "done": the serve side checks its sink too

Block i of one side pairs with block n-1-i of the other, so every block is its own NIXL descriptor, as
scattered KV blocks are. The serve side prints a token (its agent metadata and the pattern's seed) that the
connect side takes; no port besides UCX's own is used. Both report bandwidth, the UCX transports each operation
used (UCX_PROTO_INFO, read from UCX's log), and on failure the likely misconfiguration: a UCX_NET_DEVICES entry
that names no device here, no RDMA device, or a memlock limit too low to pin the buffers.

``pdpool diag kv --pool NAME -n NS`` does both through ``kubectl exec``: one prefill and one decode pod of the
pool, on different Kubernetes nodes when it can.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdpool.diag_host import (Finding, HostFacts, diagnose_failure, fmt_bytes, parse_ucx_protocols, preflight,
                              transfer_transports, transport_findings, ucx_report)

TOKEN_PREFIX = "PDPOOL-DIAG-KV-TOKEN "
RESULT_PREFIX = "PDPOOL-DIAG-KV-RESULT "
DONE = b"pdpool-diag-kv:done"
_MIX = 0x2545F4914F6CDD1D
CONNECT_TIMEOUT_S = 60.0


# ---- the pattern buffer ----------------------------------------------------------------------------------------

def pattern(seed: int, nbytes: int):
    """Deterministic bytes (same on every host): a multiply-xorshift of each 8-byte word's index."""
    import torch

    words = torch.arange(nbytes // 8, dtype=torch.int64) * _MIX + seed
    return (words ^ (words >> 29)).view(torch.uint8)


def kv_buffer(num_blocks: int, block_bytes: int, device: str):
    """A zeroed buffer in pdpool's KV layout [blocks, layers, 2, block_size, heads, head_dim], one byte each."""
    import torch

    return torch.zeros((num_blocks, 1, 2, block_bytes // 2, 1, 1), dtype=torch.uint8, device=device)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_blocks(got, want, what: str) -> str:
    """sha256 of ``want``; raises ValueError naming the first differing block."""
    got, want = got.cpu().reshape(want.shape[0], -1), want.reshape(want.shape[0], -1)
    digest = hashlib.sha256(want.numpy().tobytes()).hexdigest()[:16]
    if not bool((got == want).all()):
        bad = [i for i in range(want.shape[0]) if not bool((got[i] == want[i]).all())]
        raise ValueError(f"{what}: {len(bad)} of {want.shape[0]} blocks differ (first: block {bad[0]}); "
                         f"expected sha256 {digest}, got {hashlib.sha256(got.numpy().tobytes()).hexdigest()[:16]}")
    return digest


# ---- the two sides ------------------------------------------------------------------------------------------

class DiagFailed(Exception):
    def __init__(self, stage: str, error: str) -> None:
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error


@dataclass
class Report:
    side: str
    host: str
    ok: bool = False
    device: str = "cpu"
    bytes_per_transfer: int = 0
    descriptors: int = 0
    read_gbps: list[float] = field(default_factory=list)
    write_gbps: list[float] = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)
    transports: dict[str, list[str]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    failed_stage: str | None = None
    error: str | None = None
    peer: str | None = None
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    memlock: str | None = None     # RLIMIT_MEMLOCK (ulimit -l): RDMA pins what it registers
    rdma_ports: dict[str, str] = field(default_factory=dict)


def _stage(stage: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except DiagFailed:
        raise
    except Exception as exc:
        raise DiagFailed(stage, f"{type(exc).__name__}: {exc}") from exc


def _timed(stage: str, fn, *args, **kwargs) -> float:
    """Seconds from posting to completion. (What ``read_blocks`` returns starts after ``nixl.transfer()``
    returned, which on same-host transports such as cma or cuda_ipc already did the whole copy.)"""
    t0 = time.perf_counter()
    _stage(stage, fn, *args, **kwargs)
    return time.perf_counter() - t0


def _agent(name: str, args):
    from pdpool.kv_transfer.agent import KVAgent

    return _stage("start", KVAgent, name, ucx_tls=args.ucx_tls, ucx_net_devices=args.ucx_net_devices)


def _encode_token(payload: dict) -> str:
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(payload).encode())).decode()


def _decode_token(token: str) -> dict:
    token = token.strip()
    if token.startswith(TOKEN_PREFIX.strip()):
        token = token.split(None, 1)[1]
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(token)))


def _geometry(args) -> tuple[int, int]:
    block_bytes = args.block_kib * 1024
    return max(1, args.size_mib * 1024 * 1024 // block_bytes), block_bytes


def serve(args, report: Report) -> None:
    n, block_bytes = _geometry(args)
    seed = int.from_bytes(os.urandom(4), "little")
    agent = _agent(f"diag-serve-{report.host}#{os.getpid()}", args)
    buf = kv_buffer(2 * n, block_bytes, report.device)
    buf[:n].view(-1).copy_(pattern(seed, n * block_bytes).to(buf.device))
    _stage("register", agent.register_kv_cache, buf)
    token = _encode_token({"v": 1, "seed": seed, "blocks": n, "block_bytes": block_bytes, "host": report.host,
                           "md": base64.b64encode(agent.metadata()).decode()})
    print(TOKEN_PREFIX + token, flush=True)
    if not args.json:
        print(f"waiting up to {args.timeout:.0f}s; in the other pod run:\n  pdpool diag kv connect {token}",
              flush=True)
    _stage("wait", agent.wait_notif, None, DONE, args.timeout)
    want = pattern(seed + 1, n * block_bytes).view(n, block_bytes).flip(0)
    report.checksums["write"] = _stage("verify", check_blocks, buf[n:], want, "the blocks written into this side")
    report.bytes_per_transfer = n * block_bytes
    agent.close()


def connect(args, report: Report) -> None:
    info = _stage("token", _decode_token, args.token)
    n, block_bytes, seed = info["blocks"], info["block_bytes"], info["seed"]
    report.peer = info["host"]
    agent = _agent(f"diag-connect-{report.host}#{os.getpid()}", args)
    buf = kv_buffer(2 * n, block_bytes, report.device)
    buf[n:].view(-1).copy_(pattern(seed + 1, n * block_bytes).to(buf.device))
    _stage("register", agent.register_kv_cache, buf)
    peer = _stage("connect", agent.add_peer, base64.b64decode(info["md"]))
    # a peer behind a firewall that drops packets only times out: do not make the user wait the full --timeout
    _stage("connect", agent.warm_up, peer, min(args.timeout, CONNECT_TIMEOUT_S))
    low, high = list(range(n)), list(range(n, 2 * n))
    report.bytes_per_transfer, report.descriptors = n * block_bytes, n
    for _ in range(args.iterations):  # pull: our [0, n) <- their [0, n), reversed
        buf[:n].zero_()
        secs = _timed("read", agent.read_blocks, peer, low[::-1], low, timeout=args.timeout)
        report.read_gbps.append(n * block_bytes / secs / 1e9)
    want = pattern(seed, n * block_bytes).view(n, block_bytes).flip(0)
    report.checksums["read"] = _stage("verify", check_blocks, buf[:n], want, "the blocks read from the peer")
    for _ in range(args.iterations):  # push: our [n, 2n) -> their [n, 2n), reversed
        secs = _timed("write", agent.write_blocks, peer, high[::-1], high, timeout=args.timeout)
        report.write_gbps.append(n * block_bytes / secs / 1e9)
    buf[:n].zero_()
    _stage("read", agent.read_blocks, peer, high, low, timeout=args.timeout)  # read the written blocks back
    want = pattern(seed + 1, n * block_bytes).view(n, block_bytes).flip(0)
    report.checksums["write"] = _stage("verify", check_blocks, buf[:n], want, "the blocks written, read back")
    _stage("notify", agent.send_notif, peer, DONE)
    time.sleep(0.2)  # let the notification leave before the agent goes
    agent.close()


def run_side(side: str, args) -> Report:
    facts = HostFacts.of_this_host()
    if args.ucx_tls:
        facts.ucx_tls = args.ucx_tls
    if args.ucx_net_devices:
        facts.ucx_net_devices = args.ucx_net_devices
    report = Report(side, facts.hostname, ucx_tls=facts.ucx_tls, ucx_net_devices=facts.ucx_net_devices,
                    memlock="unlimited" if facts.memlock_bytes is None else fmt_bytes(facts.memlock_bytes),
                    rdma_ports=facts.rdma_ports)
    n, block_bytes = _geometry(args)
    pinned = 2 * n * block_bytes
    with tempfile.TemporaryDirectory(prefix="pdpool-diag-") as workdir:
        with ucx_report(workdir) as logs:
            try:
                report.device = resolve_device(args.device)
                (serve if side == "serve" else connect)(args, report)
                report.ok = True
            except DiagFailed as exc:
                report.failed_stage, report.error = exc.stage, exc.error
            ucx_log, nixl_log = logs()
    if side == "connect":  # the side that posts the transfers; UCX chooses their protocols there
        report.transports = transfer_transports(parse_ucx_protocols(ucx_log),
                                                "cuda" if report.device.startswith("cuda") else "host")
    if args.ucx_log:
        Path(args.ucx_log).write_text(ucx_log + nixl_log)
    if report.ok:
        report.findings = preflight(facts, pinned) + transport_findings(report.transports, facts)
    else:
        detail = report.error + "".join(f"\n{line}" for line in (nixl_log + ucx_log).splitlines()
                                        if re.search(r"\b(error|failed|unreachable|[EW]\d{4})\b", line, re.I))
        report.findings = diagnose_failure(report.failed_stage, detail, facts, pinned)
    return report


def render(report: Report) -> str:
    lines = [f"pdpool diag kv {report.side} on {report.host}"
             + (f" with {report.peer}" if report.peer else "") + f": {'OK' if report.ok else 'FAILED'}",
             f"  UCX_TLS={report.ucx_tls or '<all>'} UCX_NET_DEVICES={report.ucx_net_devices or '<all>'} "
             f"device={report.device}",
             f"  RDMA ports: {', '.join(f'{p} ({s})' for p, s in report.rdma_ports.items()) or 'none'}; "
             f"memlock: {report.memlock}"]
    if report.bytes_per_transfer:
        lines.append(f"  transfer: {fmt_bytes(report.bytes_per_transfer)}"
                     + (f" in {report.descriptors} descriptors" if report.descriptors else ""))
    for op, rates in (("READ (pull)", report.read_gbps), ("WRITE (push)", report.write_gbps)):
        if rates:
            lines.append(f"  {op}: median {statistics.median(rates):.3f} GB/s, best {max(rates):.3f} GB/s "
                         f"over {len(rates)} transfers")
    for what, digest in report.checksums.items():
        lines.append(f"  bytes {what}: match (sha256 {digest})")
    if report.side == "connect" and report.bytes_per_transfer:
        for op in ("read", "write"):
            names = report.transports.get(op)
            lines.append(f"  UCX transports for {op}: {', '.join(names) if names else 'not reported by UCX'}")
    if report.failed_stage:
        lines.append(f"  failed at {report.failed_stage}: {report.error.splitlines()[0]}")
    for f in report.findings:
        lines.append(f"  {f.severity}: {f.problem}\n    fix: {f.fix}")
    return "\n".join(lines)


def emit(report: Report, as_json: bool) -> int:
    if as_json:
        print(RESULT_PREFIX + json.dumps(asdict(report)), flush=True)
    else:
        print(render(report), flush=True)
    return 0 if report.ok else 1


# ---- both sides through kubectl ----------------------------------------------------------------------------

def pick_pair(prefill_pods: list[dict], decode_pods: list[dict]) -> tuple[dict, dict]:
    """A running prefill pod and a running decode pod, on different Kubernetes nodes when the pool has such a pair
    (that is the cross-node path KV takes)."""
    def running(pods):
        return [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]

    prefill, decode = running(prefill_pods), running(decode_pods)
    if not prefill or not decode:
        raise DiagFailed("pods", f"the pool has {len(prefill)} running prefill and {len(decode)} running decode pods")
    for p in prefill:
        for d in decode:
            if p["spec"].get("nodeName") != d["spec"].get("nodeName"):
                return p, d
    return prefill[0], decode[0]


def _kubectl(args) -> list[str]:
    cmd = [args.kubectl, "-n", args.namespace]
    return cmd + (["--context", args.context] if args.context else [])


def _pods(args, component: str) -> list[dict]:
    selector = f"app.kubernetes.io/instance={args.pool},app.kubernetes.io/component={component}"
    out = subprocess.run(_kubectl(args) + ["get", "pods", "-l", selector, "-o", "json"], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise DiagFailed("pods", out.stderr.strip())
    return json.loads(out.stdout)["items"]


def _side_flags(args) -> list[str]:
    flags = ["--json", "--size-mib", str(args.size_mib), "--block-kib", str(args.block_kib), "--device",
             args.device, "--timeout", str(args.timeout)]
    for name in ("ucx_tls", "ucx_net_devices"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    return flags


def _result(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def run_pool(args) -> int:
    try:
        prefill, decode = pick_pair(_pods(args, "prefill"), _pods(args, "decode"))
    except DiagFailed as exc:
        print(f"pdpool diag kv: {exc.error}", file=sys.stderr)
        return 1
    names = {role: (p["metadata"]["name"], p["spec"].get("nodeName")) for role, p in
             (("prefill", prefill), ("decode", decode))}
    print(f"prefill pod {names['prefill'][0]} (node {names['prefill'][1]}) -> decode pod {names['decode'][0]} "
          f"(node {names['decode'][1]})")
    if names["prefill"][1] == names["decode"][1]:
        print("note: both pods run on one Kubernetes node: this checks an intra-node transfer only")
    exec_ = _kubectl(args) + ["exec", "-i", "-c", args.container]
    server = subprocess.Popen(exec_ + [names["prefill"][0], "--", "pdpool", "diag", "kv", "serve", *_side_flags(args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + args.timeout
    while not any(line.startswith(TOKEN_PREFIX) for line in lines) and server.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    token = next((line.strip() for line in lines if line.startswith(TOKEN_PREFIX)), None)
    if token is None:
        server.kill()
        reader.join(5)
        served = _result("".join(lines))
        print(render(_report_from(served)) if served else f"the serve side did not start: {server.stderr.read()}")
        return 1
    client = subprocess.run(exec_ + [names["decode"][0], "--", "pdpool", "diag", "kv", "connect", "--token", "-",
                                     *_side_flags(args)], input=token + "\n", capture_output=True, text=True,
                            timeout=args.timeout + 120)
    connected = _result(client.stdout)
    try:
        server.wait(timeout=30 if connected and connected["ok"] else 5)
    except subprocess.TimeoutExpired:
        server.kill()
    reader.join(5)
    served = _result("".join(lines))
    ok = True
    for report, stderr in ((connected, client.stderr), (served, "")):
        if report is None:
            print(f"no result from a side: {stderr.strip()[-2000:]}")
            ok = False
        else:
            print(render(_report_from(report)))
            ok = ok and report["ok"]
    return 0 if ok else 1


def _report_from(d: dict) -> Report:
    d = dict(d)
    d["findings"] = [Finding(**f) for f in d.get("findings", [])]
    return Report(**d)


# ---- command line -------------------------------------------------------------------------------------------

def _add_transfer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=256, help="Bytes moved per transfer, in MiB (default 256; the "
                   "connect side takes the serve side's size and block size from its token).")
    p.add_argument("--block-kib", type=int, default=2048,
                   help="Block size in KiB: one NIXL descriptor each, as scattered KV blocks are (default 2048).")
    p.add_argument("--device", default="auto", help="Where the buffer lives: cpu, cuda, cuda:N, or auto "
                   "(cuda when present): VRAM checks the GPU path the KV cache takes.")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for this side (default: the environment's).")
    p.add_argument("--ucx-net-devices", default=None, help="UCX_NET_DEVICES for this side (default: the "
                   "environment's).")
    p.add_argument("--timeout", type=float, default=300.0, help="Seconds to wait for the peer and for each transfer.")
    p.add_argument("--json", action="store_true", help=f"Print one '{RESULT_PREFIX.strip()} {{...}}' line.")
    p.add_argument("--ucx-log", default=None, metavar="FILE", help="Also write UCX's and NIXL's log (with "
                   "UCX_PROTO_INFO's protocol tables) to FILE, e.g. for a bug report.")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdpool diag kv", description=(
        "Check a KV transfer between two pods over NIXL: bytes, bandwidth, UCX transports, and the likely "
        "misconfiguration when it fails. Either run `serve` in a prefill pod and `connect TOKEN` in a decode pod, "
        "or `--pool NAME` to have kubectl exec do both."))
    sub = p.add_subparsers(dest="side")
    s = sub.add_parser("serve", help="hold a pattern buffer and print a token for the connect side")
    _add_transfer_flags(s)
    c = sub.add_parser("connect", help="READ from and WRITE to the serve side, check bytes, report")
    c.add_argument("token", nargs="?", help="The serve side's token ('-': read it from stdin).")
    c.add_argument("--token", dest="token_opt", default=None, help="The token, or '-' for stdin.")
    c.add_argument("--iterations", type=int, default=5, help="Timed transfers each way (default 5).")
    _add_transfer_flags(c)
    p.add_argument("--pool", help="The InferencePool whose pods to use (kubectl exec).")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--context", default=None, help="kubectl context.")
    p.add_argument("--kubectl", default="kubectl")
    p.add_argument("--container", default="node", help="Container of the node pods (default node).")
    _add_transfer_flags(p)
    return p


def main(argv: list[str]) -> int:
    if argv[:1] != ["kv"]:
        print("usage: pdpool diag kv [serve | connect TOKEN | --pool NAME]  (see pdpool diag kv --help)",
              file=sys.stderr)
        return 2
    p = parser()
    args = p.parse_args(argv[1:])
    if args.side is None:
        if not args.pool:
            p.error("give serve, connect TOKEN, or --pool NAME")
        return run_pool(args)
    if args.block_kib <= 0 or args.size_mib <= 0:
        p.error("--size-mib and --block-kib must be positive")
    if args.side == "connect":
        token = args.token_opt or args.token
        if token in (None, "-"):
            token = sys.stdin.readline()
        if not token or not token.strip():
            p.error("connect needs the serve side's token")
        args.token = token
    return emit(run_side(args.side, args), args.json)
