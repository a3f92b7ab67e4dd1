"""What ``pdpool diag kv`` knows of a host and of UCX, and what it means: the host's facts (RDMA ports, UCX's
settings, the memlock limit), the findings they lead to before a transfer and after a failure, and the transports
UCX reports it chose for each operation (UCX_PROTO_INFO lines in its log). Plain data and text: no NIXL here."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

RDMA_TLS = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5", "dc",
            "dc_x", "dc_mlx5", "ib"}


@dataclass
class HostFacts:
    hostname: str
    net_devices: list[str]                  # /sys/class/net
    rdma_ports: dict[str, str]              # "mlx5_0:1" -> "ACTIVE" (/sys/class/infiniband)
    dev_infiniband: bool                    # /dev/infiniband exists (the container got the RDMA device)
    memlock_bytes: int | None               # RLIMIT_MEMLOCK soft limit; None = unlimited
    ucx_tls: str | None
    ucx_net_devices: str | None

    @classmethod
    def of_this_host(cls) -> "HostFacts":
        ports = {}
        ib = Path("/sys/class/infiniband")
        for dev in sorted(ib.iterdir()) if ib.is_dir() else []:
            for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
                state = (port / "state").read_text().strip() if (port / "state").is_file() else "?"
                ports[f"{dev.name}:{port.name}"] = state.split(":")[-1].strip()
        net = Path("/sys/class/net")
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return cls(socket.gethostname(), sorted(p.name for p in net.iterdir()) if net.is_dir() else [], ports,
                   Path("/dev/infiniband").is_dir(), None if soft == resource.RLIM_INFINITY else soft,
                   os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES"))

    def tls_set(self) -> set[str]:
        return {t.strip().lstrip("^") for t in (self.ucx_tls or "").split(",") if t.strip()}

    def wants_rdma(self) -> bool:
        return bool(self.tls_set() & RDMA_TLS) or any(":" in d for d in self._net_entries())

    def _net_entries(self) -> list[str]:
        return [d.strip() for d in (self.ucx_net_devices or "").split(",") if d.strip() and d.strip() != "all"]

    def unknown_net_devices(self) -> list[str]:
        """UCX_NET_DEVICES entries that name nothing here (``eth0``, or ``mlx5_0:1`` for an RDMA port)."""
        known = set(self.net_devices) | set(self.rdma_ports) | {p.split(":")[0] for p in self.rdma_ports}
        return [d for d in self._net_entries() if d not in known]


@dataclass
class Finding:
    severity: str   # "error": this breaks transfers; "warning": works, but slower or fragile than intended
    problem: str
    fix: str


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def preflight(facts: HostFacts, pinned_bytes: int) -> list[Finding]:
    """What is wrong with this host's settings before any transfer is tried."""
    found = []
    unknown = facts.unknown_net_devices()
    if unknown:
        rdma = ", ".join(f"{p} ({s})" for p, s in facts.rdma_ports.items()) or "none"
        found.append(Finding(
            "error", f"wrong NIC: UCX_NET_DEVICES={facts.ucx_net_devices} names {', '.join(unknown)}, which this "
            f"host ({facts.hostname}) does not have; network interfaces: {', '.join(facts.net_devices) or 'none'}; "
            f"RDMA ports: {rdma}",
            "set kvTransfer.ucxNetDevices (UCX_NET_DEVICES) to devices every node has, e.g. mlx5_0:1 for an RDMA "
            "port or eth0 for TCP, or leave it unset to let UCX choose"))
    if facts.wants_rdma() and not facts.rdma_ports:
        found.append(Finding(
            "error", f"no RDMA device: UCX_TLS={facts.ucx_tls} / UCX_NET_DEVICES={facts.ucx_net_devices} ask for "
            "InfiniBand/RoCE, but /sys/class/infiniband lists no device in this container",
            "request the RDMA device resource in the pool (e.g. rdma/ib: 1, from the RDMA device plugin) on "
            "nodes that have RDMA NICs, or drop rc/ud/dc from UCX_TLS to use TCP"))
    elif facts.rdma_ports and not facts.dev_infiniband:
        found.append(Finding(
            "error", "RDMA ports are listed in /sys/class/infiniband but /dev/infiniband is missing: the container "
            "cannot open the verbs devices", "request the RDMA device resource (e.g. rdma/ib: 1) for the pod"))
    if facts.rdma_ports and facts.memlock_bytes is not None and facts.memlock_bytes < 2 * pinned_bytes:
        found.append(Finding(
            "error" if facts.wants_rdma() else "warning",
            f"memlock limit too low: RLIMIT_MEMLOCK is {fmt_bytes(facts.memlock_bytes)} (ulimit -l), and RDMA "
            f"pins the memory it registers ({fmt_bytes(pinned_bytes)} here, the whole KV cache on a node)",
            "give the container the IPC_LOCK capability and an unlimited memlock limit (kvTransfer.rdma.ipcLock; "
            "on the container runtime, e.g. containerd's LimitMEMLOCK=infinity)"))
    if facts.rdma_ports and facts.tls_set() and not facts.wants_rdma() and "all" not in facts.tls_set():
        found.append(Finding(
            "warning", f"RDMA ports exist ({', '.join(facts.rdma_ports)}) but UCX_TLS={facts.ucx_tls} excludes them",
            "add rc (or ib) to UCX_TLS to move KV over RDMA"))
    return found


def diagnose_failure(stage: str, error: str, facts: HostFacts, pinned_bytes: int) -> list[Finding]:
    """Findings for a failed stage (``start``, ``register``, ``connect``, ``read``, ``write``, ``verify``)."""
    found = [f for f in preflight(facts, pinned_bytes) if f.severity == "error"]
    text = error.lower()
    if stage == "register" or any(s in text for s in ("cannot allocate memory", "enomem", "mlock", "memlock")):
        if not any("memlock" in f.problem for f in found):
            found.append(Finding(
                "error", f"memory registration failed ({fmt_bytes(pinned_bytes)}); memlock limit "
                f"{'unlimited' if facts.memlock_bytes is None else fmt_bytes(facts.memlock_bytes)}",
                "give the container IPC_LOCK and an unlimited memlock limit; for --device cuda the GPU must "
                "support GPUDirect RDMA (nvidia-peermem) or UCX_TLS must include cuda_copy"))
    if found:
        return found
    if stage == "start":
        found.append(Finding(
            "error", f"UCX found no usable transport (UCX_TLS={facts.ucx_tls or 'all'}, "
            f"UCX_NET_DEVICES={facts.ucx_net_devices or 'all'}): {error}",
            "unset UCX_TLS and UCX_NET_DEVICES to let UCX choose, then narrow them again; on a GPU host keep "
            "cuda_copy in UCX_TLS (UCX_TLS=tcp alone failed to start NIXL on an H100 host, tcp,cuda_copy worked)"))
    elif stage in ("connect", "read", "write"):
        found.append(Finding(
            "error", f"the peer did not answer over UCX ({stage}): {error}",
            "the two pods must reach each other on every port (UCX's TCP transport uses ephemeral ports; the "
            "pool's NetworkPolicy allows node-to-node traffic): check NetworkPolicies, that the serve side still "
            "runs, and that UCX_NET_DEVICES on both sides names an interface whose address the other pod can route "
            "to"))
    elif stage == "verify":
        found.append(Finding(
            "error", f"the transfer finished but the bytes differ: {error}",
            "for GPU memory, check GPUDirect RDMA (nvidia-peermem loaded) or add cuda_copy to UCX_TLS; for host "
            "memory, report a bug with this output"))
    else:
        found.append(Finding("error", error, "see the UCX log lines above"))
    return found


def transport_findings(transports: dict[str, list[str]], facts: HostFacts) -> list[Finding]:
    used = {t for ts in transports.values() for t in ts}
    if facts.rdma_ports and used and all(t.startswith("tcp/") for t in used):
        return [Finding("warning", f"RDMA ports exist ({', '.join(facts.rdma_ports)}) but KV moved over "
                        f"{', '.join(sorted(used))}",
                        "check UCX_TLS (include rc), UCX_NET_DEVICES (an RDMA port, e.g. mlx5_0:1) and memlock")]
    return []


# ---- UCX's own report of the transports it chose --------------------------------------------------------------

_LOG_LINE = re.compile(r"^\[(?P<ts>[^\]]+)\]\s+\[(?P<where>[^\]]+)\]\s+(?P<text>.*)$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")


def parse_ucx_protocols(log_text: str) -> list[tuple[str, str, list[str]]]:
    """UCX_PROTO_INFO tables -> ``[(title, operation, ["transport/device", ...])]``.

    UCX prints each protocol selection as a table::

        +----------------------------------------------------------+
        | <worker> inter-node cfg#1                                |
        | remote memory read by ucp_get* into host memory from host |
        +-----------+--------------------+-------------------------+
        |   Range   |    Description     |          Config         |
        +-----------+--------------------+-------------------------+
        |   0..8184 | zero-copy          | rc_mlx5/mlx5_0:1        |

    A one-cell row after data rows starts the next table (tables are printed back to back)."""
    tables: list[tuple[list[str], list[str]]] = []
    for line in log_text.splitlines():
        m = _LOG_LINE.match(line.strip())
        if not m or not m["text"].startswith("|"):
            continue
        cells = [c.strip() for c in m["text"].strip().strip("|").split("|")]
        if len(cells) == 1:
            if not tables or tables[-1][1]:
                tables.append(([], []))
            tables[-1][0].append(cells[0])
        elif tables and len(cells) == 3 and cells[0] != "Range":
            tables[-1][1].append(cells[2])
    found = []
    for heads, configs in tables:
        if len(heads) < 2:
            continue
        names: list[str] = []
        for config in configs:
            for tl, dev in _TRANSPORT.findall(config):
                if f"{tl}/{dev}" not in names:
                    names.append(f"{tl}/{dev}")
        found.append((heads[0], heads[1], names))
    return found


_OPERATION = re.compile(r"remote memory (?:(?P<read>read) by \S+ into (?P<rdst>.+?) from (?P<rsrc>.+)"
                        r"|(?P<write>write) by \S+ from (?P<wsrc>.+?) to (?P<wdst>.+))$")


def transfer_transports(tables: list[tuple[str, str, list[str]]], mem: str) -> dict[str, list[str]]:
    """The transports UCX chose for remote READs and WRITEs between two buffers of ``mem`` ("host" or "cuda")
    memory (UCX names them ``host memory``/``host`` and ``cuda/GPU0``/``cuda/dev[1]``/``cuda``), leaving out an
    agent's loopback to itself (``self`` tables)."""
    found: dict[str, list[str]] = {}
    for title, operation, names in tables:
        m = _OPERATION.match(operation)
        if not m or " self " in f" {title} ":
            continue
        op = "read" if m["read"] else "write"
        ends = (m["rdst"], m["rsrc"]) if m["read"] else (m["wsrc"], m["wdst"])
        if all(end.split("/")[0].split()[0] == mem for end in ends):
            for name in names:
                if name not in found.setdefault(op, []):
                    found[op].append(name)
    return found


@contextlib.contextmanager
def ucx_report(workdir: str):
    """UCX_PROTO_INFO on, UCX's log into ``workdir`` (UCX reads both when NIXL creates its context), and the
    process's stderr (NIXL's own log) copied there too; yields a callable returning (ucx log, nixl log)."""
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = os.path.join(workdir, "ucx.%p.log")  # --ucx-log keeps a copy
    captured = os.path.join(workdir, "stderr.log")
    sys.stderr.flush()
    saved = os.dup(2)
    with open(captured, "wb") as sink:
        os.dup2(sink.fileno(), 2)

    def read() -> tuple[str, str]:
        ucx = "".join(p.read_text(errors="replace") for p in sorted(Path(workdir).glob("ucx.*.log")))
        return ucx, Path(captured).read_text(errors="replace")

    try:
        yield read
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr.write(Path(captured).read_text(errors="replace"))

