"""``pdpool diag kv`` between two local processes: real NIXL agents (UCX over TCP, host memory), as a user runs it.

One serve process holds a pattern buffer for the module. Tests run in file order: a connect side with a
UCX_NET_DEVICES entry this host lacks fails at once and names it (the serve side keeps waiting); a good connect
side moves and checks the bytes both ways, reports bandwidth and UCX's transports, and the serve side checks
what was written into it and exits; a connect to the exited side fails and says the peer did not answer.
The diagnosis rules for RDMA hosts (no device, /dev/infiniband missing, memlock) are checked on host facts.
``--pool`` finds the pool's pods with the real kubectl against the API emulator, whose exec answers 501: the
transfer through ``kubectl exec`` itself needs a real cluster.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the tests/ folder: the API emulator and kubectl fixtures
from k8s_fixtures import k8s, kubeconfig, kubectl  # noqa: E402,F401
from k8s_tools import kubectl_path  # noqa: E402

from pdpool.diag import RESULT_PREFIX, TOKEN_PREFIX, pick_pair
from pdpool.diag_host import HostFacts, diagnose_failure, parse_ucx_protocols, preflight, transfer_transports

pytestmark = pytest.mark.timeout(300)

SIZE = ["--size-mib", "4", "--block-kib", "64"]   # 64 blocks of 64 KiB: 64 descriptors per transfer
TCP = ["--ucx-tls", "tcp,self"]
NUM_BLOCKS, BLOCK_BYTES = 64, 64 * 1024


def diag(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdpool.cli", "diag", "kv", *args], input=stdin, cwd="/tmp",
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def result_of(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len(RESULT_PREFIX):])


@pytest.fixture(scope="module")
def server():
    """The serve side: (process, token). It exits after one successful connect."""
    proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", "diag", "kv", "serve", "--json", *SIZE, *TCP,
                             "--timeout", "240"], cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    token, seen = None, []
    deadline = time.monotonic() + 120
    while token is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(TOKEN_PREFIX):
            token = line[len(TOKEN_PREFIX):].strip()
    assert token, f"no token from the serve side: {''.join(seen)[-2000:]} {proc.stderr.read()[-2000:]}"
    yield proc, token
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_bad_ucx_net_devices_is_named(server):
    _, token = server
    done = diag("connect", "--token", "-", "--json", *SIZE, "--ucx-net-devices", "bogus0", "--timeout", "10",
                stdin=token + "\n")
    assert done.returncode == 1, done.stdout[-2000:]
    report = result_of(done.stdout)
    assert not report["ok"] and report["failed_stage"] == "start"
    wrong_nic = [f for f in report["findings"] if f["problem"].startswith("wrong NIC")]
    assert wrong_nic and wrong_nic[0]["severity"] == "error", report["findings"]
    assert "UCX_NET_DEVICES=bogus0" in wrong_nic[0]["problem"]
    for nic in os.listdir("/sys/class/net"):  # it lists what the host does have
        assert nic in wrong_nic[0]["problem"]
    assert "kvTransfer.ucxNetDevices" in wrong_nic[0]["fix"]


def test_transfer_both_ways_checks_bytes_and_reports(server):
    proc, token = server
    done = diag("connect", "--token", "-", "--json", "--iterations", "3", *SIZE, *TCP, "--timeout", "60",
                stdin=token + "\n")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = result_of(done.stdout)
    assert report["ok"] and report["failed_stage"] is None
    assert report["bytes_per_transfer"] == NUM_BLOCKS * BLOCK_BYTES
    assert report["descriptors"] == NUM_BLOCKS  # block i <- block n-1-i: no two blocks merge
    assert len(report["read_gbps"]) == len(report["write_gbps"]) == 3
    assert all(rate > 0 for rate in report["read_gbps"] + report["write_gbps"])
    assert set(report["checksums"]) == {"read", "write"}
    # UCX's own report of what carried the READ: TCP here (UCX_TLS=tcp,self), on a device this host has
    assert report["transports"]["read"], report["transports"]
    for name in report["transports"]["read"]:
        transport, device = name.split("/", 1)
        assert transport == "tcp" and device in os.listdir("/sys/class/net"), name
    assert not [f for f in report["findings"] if f["severity"] == "error"]
    # the serve side checked the blocks written into it, independently, and exited
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    served = result_of(out)
    assert served["ok"] and served["checksums"]["write"] == report["checksums"]["write"]


def test_an_unreachable_peer_is_reported(server):
    proc, token = server
    assert proc.poll() is not None  # the previous test's connect ended it
    done = diag("connect", "--token", "-", "--json", *SIZE, *TCP, "--timeout", "10", stdin=token + "\n")
    assert done.returncode == 1
    report = result_of(done.stdout)
    assert report["failed_stage"] == "connect", report
    assert report["findings"][0]["problem"].startswith("the peer did not answer over UCX")
    assert "NetworkPolic" in report["findings"][0]["fix"]


def test_a_serve_side_with_a_bad_nic_prints_no_token():
    done = diag("serve", "--json", *SIZE, "--ucx-net-devices", "eth9:1,bogus0", "--timeout", "5")
    assert done.returncode == 1
    assert TOKEN_PREFIX not in done.stdout
    report = result_of(done.stdout)
    problems = " ".join(f["problem"] for f in report["findings"])
    assert "names eth9:1, bogus0" in problems
    assert "no RDMA device" in problems  # eth9:1 is an RDMA port name, and this host has none


def test_human_output_and_help():
    done = diag("--help")
    assert done.returncode == 0 and "--pool" in done.stdout
    done = diag("serve", *SIZE, "--ucx-net-devices", "bogus0", "--timeout", "5")
    assert done.returncode == 1
    assert "pdpool diag kv serve on" in done.stdout and "FAILED" in done.stdout
    assert "fix: set kvTransfer.ucxNetDevices" in done.stdout


# ---- the diagnosis rules, on host facts -----------------------------------------------------------------------

def facts(**overrides) -> HostFacts:
    base = dict(hostname="gpu-node-3", net_devices=["eth0", "lo"], rdma_ports={"mlx5_0:1": "ACTIVE"},
                dev_infiniband=True, memlock_bytes=None, ucx_tls="rc,cuda_copy,tcp", ucx_net_devices="mlx5_0:1")
    return HostFacts(**{**base, **overrides})


def problems(findings) -> str:
    return " | ".join(f"{f.severity}: {f.problem}" for f in findings)


def test_this_hosts_facts_are_read():
    here = HostFacts.of_this_host()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert here.memlock_bytes == (None if soft == resource.RLIM_INFINITY else soft)
    assert "lo" in here.net_devices


def test_a_well_configured_rdma_host_has_no_findings():
    assert preflight(facts(), 1 << 30) == []


def test_memlock_too_low_for_rdma():
    found = preflight(facts(memlock_bytes=8 << 20), 1 << 30)
    assert "error: memlock limit too low: RLIMIT_MEMLOCK is 8.0 MiB" in problems(found)
    assert "IPC_LOCK" in found[0].fix
    # a registration that fails names memlock even when the limit looked large enough
    found = diagnose_failure("register", "nixlBackendError: NIXL_ERR_BACKEND", facts(memlock_bytes=4 << 30), 1 << 30)
    assert "memory registration failed" in problems(found)


def test_no_rdma_device():
    found = preflight(facts(rdma_ports={}, dev_infiniband=False), 1 << 30)
    assert "no RDMA device" in problems(found) and "rdma/ib" in found[-1].fix
    found = preflight(facts(dev_infiniband=False), 1 << 30)
    assert "/dev/infiniband is missing" in problems(found)


def test_wrong_nic_on_an_rdma_host():
    found = preflight(facts(ucx_net_devices="mlx5_1:1"), 1 << 30)
    assert problems(found).startswith("error: wrong NIC: UCX_NET_DEVICES=mlx5_1:1 names mlx5_1:1")
    assert "mlx5_0:1 (ACTIVE)" in found[0].problem


def test_rdma_left_unused_is_a_warning():
    found = preflight(facts(ucx_tls="tcp", ucx_net_devices="eth0"), 1 << 30)
    assert problems(found) == "warning: RDMA ports exist (mlx5_0:1) but UCX_TLS=tcp excludes them"


def test_ucx_proto_info_tables_are_parsed():
    """Two tables printed back to back (one timestamp), an RDMA one split over two ports, and a loopback."""
    log = "\n".join(f"[1.5] [h:1:0]   {line}" for line in [
        "+------+",
        "| w#1 inter-node cfg#2 |",
        "| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |",
        "+------+",
        "|  Range  | Description | Config |",
        "|  0..8k  | zero-copy   | rc_mlx5/mlx5_0:1 |",
        "| 8k..inf | zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |",
        "+------+",
        "| w#1 inter-node cfg#2 |",
        "| remote memory read by ucp_get* into host memory from host |",
        "|  0..inf | software emulation | tcp/eth0 |",
        "| w#1 intra-node cfg#3 |",
        "| remote memory write by ucp_put* from host memory to cuda/dev[1] |",
        "|  0..inf | software emulation | tcp/lo |",
        "| w#1 self cfg#0 |",
        "| remote memory write by ucp_put* from cuda/GPU0 to cuda |",
        "|  0..inf | short | self/memory |",
    ]) + "\nunrelated line\n"
    tables = parse_ucx_protocols(log)
    assert [t[2] for t in tables] == [["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"], ["tcp/eth0"], ["tcp/lo"],
                                      ["self/memory"]]
    assert transfer_transports(tables, "cuda") == {"read": ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"]}
    assert transfer_transports(tables, "host") == {"read": ["tcp/eth0"]}


def pod(name: str, node: str, phase: str = "Running") -> dict:
    return {"metadata": {"name": name}, "spec": {"nodeName": node}, "status": {"phase": phase}}


def test_pod_pair_prefers_two_kubernetes_nodes():
    p, d = pick_pair([pod("p0", "n1"), pod("p1", "n2")], [pod("d0", "n1"), pod("d1", "n3", "Pending")])
    assert (p["metadata"]["name"], d["metadata"]["name"]) == ("p1", "d0")
    p, d = pick_pair([pod("p0", "n1")], [pod("d0", "n1")])  # only one node: still a check, intra-node
    assert (p["metadata"]["name"], d["metadata"]["name"]) == ("p0", "d0")
    with pytest.raises(Exception, match="0 running decode pods"):
        pick_pair([pod("p0", "n1")], [pod("d0", "n1", "Pending")])


def pod_manifest(name: str, pool: str, component: str, node: str) -> dict:
    labels = {"app.kubernetes.io/instance": pool, "app.kubernetes.io/component": component,
              "app.kubernetes.io/part-of": "pdpool"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "node", "image": "ghcr.io/pdpool/pdpool:0.1.0"}]}}


def test_pool_mode_picks_pods_on_two_nodes_with_kubectl(k8s, kubectl):
    for name, pool, component, node, phase in [
            ("demo-prefill-a", "demo", "prefill", "gpu-1", "Running"),
            ("demo-prefill-b", "demo", "prefill", "gpu-2", "Running"),
            ("demo-decode-a", "demo", "decode", "gpu-1", "Running"),
            ("demo-decode-b", "demo", "decode", "gpu-3", "Pending"),
            ("other-decode-a", "other", "decode", "gpu-4", "Running")]:
        kubectl("apply", "-f", "-", input=json.dumps(pod_manifest(name, pool, component, node)))
        k8s.set_status("v1", "pods", "default", name, {"phase": phase})
    done = subprocess.run([sys.executable, "-m", "pdpool.cli", "diag", "kv", "--pool", "demo", "-n", "default",
                           "--kubectl", str(kubectl_path()), "--timeout", "30", *SIZE], cwd="/tmp",
                          capture_output=True, text=True, timeout=120, env={**os.environ, **kubectl.env})
    assert "prefill pod demo-prefill-b (node gpu-2) -> decode pod demo-decode-a (node gpu-1)" in done.stdout, \
        done.stdout + done.stderr
    assert done.returncode == 1  # the emulator has no exec: the serve side never starts, and that is said
    assert "the serve side did not start" in done.stdout

    done = subprocess.run([sys.executable, "-m", "pdpool.cli", "diag", "kv", "--pool", "absent", "--kubectl",
                           str(kubectl_path())], cwd="/tmp", capture_output=True, text=True, timeout=120,
                          env={**os.environ, **kubectl.env})
    assert done.returncode == 1 and "0 running prefill and 0 running decode pods" in done.stderr
