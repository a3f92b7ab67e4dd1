"""KV handoff between two GPUs of one host: NIXL READ (pull) and WRITE (push) against a torch peer copy, and the
handoff's share of TTFT, in one run.

Two processes, one GPU each, as in a deployment: a prefill process (spawned, ``--src-gpu``) holds a KV cache in
pdpool's layout filled with a known pattern; this process is the decode node (``--dst-gpu``). Both register their
cache with a ``pdpool.kv_transfer.KVAgent`` and exchange its metadata. Shape: Llama-3.1-8B's KV (32 layers,
8 KV heads, head dim 128, bf16) at block size 16, so one block is 32 * 2 * 16 * 8 * 128 * 2 B = 2 MiB::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]    one byte range per block

For 1k, 8k and 32k tokens, block ids ascending on both sides (a fresh allocation: one descriptor per transfer)
and shuffled (a fragmented pool: one descriptor per block):

* pull: the decode process READs the prefill blocks into its own (``KVAgent.read_blocks``), timed here;
* push: the prefill process WRITEs its blocks into the decode blocks (``KVAgent.write_blocks``), timed there;
* peer copy: ``dst.copy_(src)`` of the same bytes from the source GPU to the destination GPU, one process.

Before every transfer the whole destination cache is overwritten with random bits; after it, every destination
block is compared bit for bit with the pattern of its source block. Times are wall-clock medians around the
agent call (descriptors, post, completion polling), after one untimed transfer of each kind. The first transfer
in each direction pays the UCX connection set-up (the agent connects and warms up on first use); it is reported
as "cold". Then, in a fresh process on the source GPU: the engine's prefill of an 8k-token prompt (TTFT of a
prefill node, dummy weights), to put the 8k transfer in proportion.

    python3 benchmarks/kv_handoff_gpu.py [--reps 20] [--tokens 1024,8192,32768]
    .venv/bin/python benchmarks/kv_handoff_gpu.py --device cpu --tiny    # CPU smoke test (host memory)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: the repo root holds an `operator/` that must not shadow the stdlib's

LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
TINY_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=10240)
TIMEOUT_S = 60.0
QUEUE_TIMEOUT_S = 300.0


# --- the cache, its known pattern and the check ------------------------------------------------------------

def kv_shape(shape: dict, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, shape["num_layers"], 2, shape["block_size"], shape["num_kv_heads"], shape["head_dim"])


def pattern(block_ids, block_elems: int):
    """int16 bits of blocks ``block_ids`` of the source cache: a hash of the element's global index."""
    import torch

    j = torch.arange(block_elems, dtype=torch.int64, device=block_ids.device)
    x = (block_ids[:, None] * block_elems + j) * 2654435761  # [n, block_elems]
    return (((x >> 8) & 0xFFFF) - 32768).to(torch.int16)


def blocks_of(kv):
    """``kv`` as int16 rows, one per block: [num_blocks, block_elems] (bf16 bits, compared exactly)."""
    import torch

    return kv.view(torch.int16).view(kv.shape[0], -1)


def _chunks(ids, block_elems: int):
    step = max(1, (1 << 26) // block_elems)  # 64 Mi elements per chunk: bounded int64 temporaries
    for i in range(0, len(ids), step):
        yield i, ids[i:i + step]


def fill_source(kv) -> None:
    import torch

    rows = blocks_of(kv)
    ids = torch.arange(kv.shape[0], device=kv.device)
    for i, chunk in _chunks(ids, rows.shape[1]):
        rows[i:i + len(chunk)] = pattern(chunk, rows.shape[1])


def scramble(kv) -> None:
    """Random bits over the whole destination cache, so a block the transfer missed cannot pass the check."""
    blocks_of(kv).random_()


def count_wrong_blocks(kv, dst_ids, src_ids) -> int:
    """Destination blocks whose bits differ from their source block's pattern (0: the transfer is exact)."""
    import torch

    rows = blocks_of(kv)
    dst = torch.tensor(dst_ids, device=kv.device)
    src = torch.tensor(src_ids, device=kv.device)
    wrong = 0
    for i, chunk in _chunks(dst, rows.shape[1]):
        got, want = rows[chunk], pattern(src[i:i + len(chunk)], rows.shape[1])
        wrong += int((got != want).any(dim=1).sum())
    return wrong


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_ids(num_tokens: int, block_size: int, num_blocks: int, order: str, rng: random.Random):
    """(source ids, destination ids): ascending from 0 on both sides, or a random sample on each."""
    n = -(-num_tokens // block_size)
    if order == "ascending":
        return list(range(n)), list(range(n))
    return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)


# --- the prefill process -------------------------------------------------------------------------------------

def prefill_process(spec: dict, commands, results) -> None:
    """Holds the source cache; on command, WRITEs blocks into the decode cache and reports the time."""
    agent = None
    try:
        import torch

        from pdpool.kv_transfer.agent import KVAgent

        device = torch.device(spec["device"], spec["src_gpu"]) if spec["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kv = torch.empty(spec["kv_shape"], dtype=torch.bfloat16, device=device)
        fill_source(kv)
        sync(device)
        agent = KVAgent(f"prefill-{os.getpid()}#bench", **spec["agent"])
        agent.register_kv_cache(kv)
        results.put(("ready", agent.metadata()))
        peer = None
        while True:
            cmd, arg = commands.get(timeout=QUEUE_TIMEOUT_S)
            if cmd == "peer":
                peer = agent.add_peer(arg)
                results.put(("ok", None))
            elif cmd == "write":
                src_ids, dst_ids = arg
                t0 = time.perf_counter()
                posted = agent.write_blocks(peer, remote_block_ids=dst_ids, local_block_ids=src_ids,
                                            timeout=TIMEOUT_S)
                results.put(("wrote", (time.perf_counter() - t0, posted)))
            elif cmd == "exit":
                break
    except Exception:
        results.put(("error", traceback.format_exc()))
    finally:
        if agent is not None:
            agent.close()


def receive(results, proc, what: str):
    """The next message of a child process; raises at once if it died, or after QUEUE_TIMEOUT_S."""
    import queue

    deadline = time.perf_counter() + QUEUE_TIMEOUT_S
    while time.perf_counter() < deadline:
        try:
            return results.get(timeout=2)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} died (exit code {proc.exitcode}) before {what!r}") from None
    raise RuntimeError(f"{proc.name} sent no {what!r} within {QUEUE_TIMEOUT_S:.0f}s")


def expect(results, what: str, proc):
    kind, value = receive(results, proc, what)
    if kind == "error":
        raise RuntimeError(f"prefill process failed:\n{value}")
    if kind != what:
        raise RuntimeError(f"prefill process answered {kind!r}, expected {what!r}")
    return value


# --- peer copy -----------------------------------------------------------------------------------------------

def peer_copy(args, shape: dict, block_bytes: int) -> dict:
    """Median wall time of ``dst.copy_(src)`` (source GPU -> destination GPU) for each transfer size."""
    import torch

    if args.device == "cuda":
        src_dev, dst_dev = torch.device("cuda", args.src_gpu), torch.device("cuda", args.dst_gpu)
        info = dict(can_access_peer=torch.cuda.can_device_access_peer(args.dst_gpu, args.src_gpu))
    else:
        src_dev = dst_dev = torch.device("cpu")
        info = dict(can_access_peer=None)
    most = max(-(-t // shape["block_size"]) for t in args.tokens) * block_bytes
    src = torch.randint(-32768, 32767, (most // 2,), dtype=torch.int16, device=src_dev)
    dst = torch.empty(most // 2, dtype=torch.int16, device=dst_dev)
    for tokens in args.tokens:
        n = -(-tokens // shape["block_size"]) * block_bytes // 2
        samples = []
        for rep in range(args.reps + 1):
            sync(src_dev)
            sync(dst_dev)
            t0 = time.perf_counter()
            dst[:n].copy_(src[:n])
            sync(src_dev)
            sync(dst_dev)
            if rep:
                samples.append(time.perf_counter() - t0)
        assert torch.equal(dst[:n].cpu(), src[:n].cpu()), "peer copy moved wrong bytes"
        info[tokens] = statistics.median(samples)
    del src, dst
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return info


# --- the handoff (this process is the decode node) -----------------------------------------------------------

def handoff(args, shape: dict) -> dict:
    import torch

    from pdpool.kv_transfer.agent import KVAgent
    from pdpool.kv_transfer.layout import block_runs

    max_blocks = max(-(-t // shape["block_size"]) for t in args.tokens)
    num_blocks = max_blocks + 64  # room to shuffle
    agent_args = dict(ucx_tls=args.ucx_tls, num_threads=args.num_threads, split_batch_size=args.split_batch_size)
    spec = dict(device=args.device, src_gpu=args.src_gpu, kv_shape=kv_shape(shape, num_blocks), agent=agent_args)
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_process, args=(spec, commands, results), daemon=True)
    proc.start()
    device = torch.device("cuda", args.dst_gpu) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kv = torch.zeros(spec["kv_shape"], dtype=torch.bfloat16, device=device)
    agent = KVAgent(f"decode-{os.getpid()}#bench", **agent_args)
    agent.register_kv_cache(kv)
    out = dict(num_blocks=num_blocks, block_bytes=agent.region.block_bytes, mem_type=agent.region.mem_type,
               cases=[])
    try:
        peer = agent.add_peer(expect(results, "ready", proc))
        commands.put(("peer", agent.metadata()))
        expect(results, "ok", proc)

        def pull(src_ids, dst_ids):
            t0 = time.perf_counter()
            posted = agent.read_blocks(peer, remote_block_ids=src_ids, local_block_ids=dst_ids, timeout=TIMEOUT_S)
            return time.perf_counter() - t0, posted

        def push(src_ids, dst_ids):
            commands.put(("write", (src_ids, dst_ids)))
            return expect(results, "wrote", proc)

        def checked(transfer, src_ids, dst_ids):
            scramble(kv)
            sync(device)
            wall, posted = transfer(src_ids, dst_ids)
            wrong = count_wrong_blocks(kv, dst_ids, src_ids)
            if wrong:
                raise RuntimeError(f"{transfer.__name__}: {wrong} of {len(dst_ids)} blocks differ from the source")
            return wall, posted

        rng = random.Random(0)
        first_src, first_dst = block_ids(args.tokens[0], shape["block_size"], num_blocks, "ascending", rng)
        for name, transfer in (("pull", pull), ("push", push)):  # first contact in each direction
            out[f"cold_{name}_s"] = checked(transfer, first_src, first_dst)[0]
        out["cold_tokens"] = args.tokens[0]
        for tokens in args.tokens:
            for order in args.orders:
                src_ids, dst_ids = block_ids(tokens, shape["block_size"], num_blocks, order, rng)
                for name, transfer in (("pull", pull), ("push", push)):
                    checked(transfer, src_ids, dst_ids)  # untimed: UCX picks its protocol per size on first use
                    walls, posted = zip(*(checked(transfer, src_ids, dst_ids) for _ in range(args.reps)))
                    case = dict(tokens=tokens, order=order, mode=name, blocks=len(src_ids),
                                descriptors=len(block_runs(dst_ids, src_ids)),
                                bytes=len(src_ids) * out["block_bytes"], wall_s=statistics.median(walls),
                                wall_min_s=min(walls), posted_s=statistics.median(posted), verified=True)
                    if name == "pull":
                        case["phases_s"] = pull_phases(agent, peer, src_ids, dst_ids)
                    out["cases"].append(case)
                    print(f"{name:<5}{tokens:>7} tok {order:<10} {case['descriptors']:>5} descs  "
                          f"{case['wall_s'] * 1e3:8.3f} ms  {case['bytes'] / case['wall_s'] / 1e9:7.1f} GB/s",
                          flush=True)
        out["agent_stats"] = vars(agent.stats)
        commands.put(("exit", None))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        agent.close()
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def pull_phases(agent, peer: str, src_ids, dst_ids, reps: int = 5) -> dict:
    """Where a pull's time goes (medians): descriptor lists (Python), NIXL request set-up, posting the
    descriptors, and completion after the post (polled without sleeping). Timing only: no check."""
    from pdpool.kv_transfer.layout import descriptors

    nixl, remote = agent._nixl, agent.peer_region(peer)
    phases: dict[str, list[float]] = {"descriptors": [], "prepare": [], "post": [], "completion": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        local, far = descriptors(agent.region, remote, dst_ids, src_ids)
        t1 = time.perf_counter()
        handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, agent.region.mem_type),
                                      nixl.get_xfer_descs(far, remote.mem_type), peer, b"")
        t2 = time.perf_counter()
        nixl.transfer(handle)
        t3 = time.perf_counter()
        while (state := nixl.check_xfer_state(handle)) != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
        t4 = time.perf_counter()
        nixl.release_xfer_handle(handle)
        for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[key].append(dt)
    return {key: statistics.median(v) for key, v in phases.items()}


# --- TTFT of the prefill ---------------------------------------------------------------------------------------

def ttft_process(spec: dict, results) -> None:
    """The engine's prefill of a ``num_tokens`` prompt (max_tokens 1), per token budget of one engine step."""
    try:
        if spec["device"] == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["gpu"])
        import tempfile

        import torch

        sys.path.append(str(ROOT / "benchmarks"))
        from gpu_e2e import model_folder

        from pdpool import LLM, SamplingParams

        n = spec["num_tokens"]
        folder = model_folder(spec["model"], Path(tempfile.mkdtemp(prefix="pdpool-ttft-")), spec["overrides"])
        cfg = json.loads((folder / "config.json").read_text())
        budgets = sorted({n, 2048}, reverse=True)
        llm = LLM(str(folder), dtype="bfloat16" if spec["device"] == "cuda" else "float32", device=spec["device"],
                  load_format="dummy", max_num_seqs=4, max_num_batched_tokens=max(budgets), max_model_len=n + 64,
                  num_kv_blocks=2 * (n // 16 + 8), enforce_eager=True)
        rng = random.Random(1)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        out = dict(model=spec["model"], num_tokens=n, runs={})
        for budget in budgets:
            llm.engine.scheduler.max_num_batched_tokens = budget
            samples = []
            for rep in range(spec["reps"] + 1):  # fresh random prompts: no prefix-cache hits
                prompt = [rng.randrange(100, cfg["vocab_size"]) for _ in range(n)]
                if spec["device"] == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                if rep:
                    samples.append(time.perf_counter() - t0)
            out["runs"][budget] = dict(median_s=statistics.median(samples), min_s=min(samples))
        results.put(("ttft", out))
    except Exception:
        results.put(("error", traceback.format_exc()))


def ttft(args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    spec = dict(device=args.device, gpu=args.src_gpu, num_tokens=args.ttft_tokens, reps=3, model="Llama-3.1-8B",
                overrides=TINY_MODEL if args.tiny else None)
    proc = ctx.Process(target=ttft_process, args=(spec, results), daemon=True)
    proc.start()
    try:
        kind, value = receive(results, proc, "ttft")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if kind == "error":
        raise RuntimeError(value)
    return value


# --- report --------------------------------------------------------------------------------------------------

def environment(args) -> dict:
    import torch

    env = dict(torch=torch.__version__, python=sys.version.split()[0],
               ucx={k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))})
    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            from importlib.metadata import version
            env["nixl"] = f"{name.replace('_', '-')} {version(name.replace('_', '-'))}"
            break
        except Exception:
            continue
    if args.device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        for key, cmd in (("topo", ["nvidia-smi", "topo", "-m"]), ("nvlink", ["nvidia-smi", "nvlink", "-s"]),
                         ("driver", ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])):
            try:
                env[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            except Exception as exc:
                env[key] = f"{cmd}: {exc}"
    return env


def report(res: dict) -> None:
    h = res["handoff"]
    peer = res["peer_copy"]
    print(f"\nKV handoff, {res['shape']} ({h['block_bytes']} B/block, {h['mem_type']}), median of {res['reps']}; "
          f"peer copy: torch dst.copy_(src) across GPUs (can_access_peer={peer['can_access_peer']})\n")
    head = (f"{'tokens':>7}{'MB':>8} {'ids':<10} | {'pull (READ)':>22} | {'push (WRITE)':>22} | "
            f"{'peer copy':>16}")
    print(head)
    print("-" * len(head))
    for tokens in res["tokens"]:
        for order in res["orders"]:
            cells = []
            for mode in ("pull", "push"):
                c = next(c for c in h["cases"] if c["tokens"] == tokens and c["order"] == order and c["mode"] == mode)
                gbs = c["bytes"] / c["wall_s"] / 1e9
                cells.append(f"{c['wall_s'] * 1e3:7.3f}ms {gbs:6.1f}GB/s {c['ratio']:4.0%}")
            p = peer[tokens]
            print(f"{tokens:>7}{c['bytes'] / 1e6:>8.0f} {order:<10} | " + " | ".join(cells)
                  + f" | {p * 1e3:6.3f}ms {c['bytes'] / p / 1e9:5.1f}GB/s")
    for c in h["cases"]:
        if "phases_s" in c:
            ph = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in c["phases_s"].items())
            print(f"pull {c['tokens']:>6} tok {c['order']:<10} phases (ms): {ph}")
    print(f"cold first transfer ({h['cold_tokens']} tokens, connection set-up + warm-up + transfer): "
          f"pull {h['cold_pull_s'] * 1e3:.1f} ms, push {h['cold_push_s'] * 1e3:.1f} ms")
    if "ttft" in res:
        t = res["ttft"]
        for budget, run in t["runs"].items():
            print(f"TTFT prefill of {t['num_tokens']} tokens ({t['model']}, token budget {budget}): "
                  f"{run['median_s'] * 1e3:.1f} ms")
        for s in res.get("ttft_share", []):
            print(f"  {s['mode']} of {t['num_tokens']} tokens: {s['transfer_s'] * 1e3:.2f} ms = {s['share']:.1%} of "
                  f"prefill + transfer (token budget {s['budget']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small KV shape, sizes and model: a CPU smoke test")
    ap.add_argument("--tokens", default=None, help="comma-separated prompt lengths (default 1024,8192,32768)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--src-gpu", type=int, default=0, help="the prefill GPU (holds the KV)")
    ap.add_argument("--dst-gpu", type=int, default=1, help="the decode GPU (receives it)")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both agents (default: UCX's own choice)")
    ap.add_argument("--num-threads", type=int, default=0, help="KVAgent num_threads (NIXL UCX worker threads)")
    ap.add_argument("--split-batch-size", type=int, default=None, help="KVAgent split_batch_size (with threads)")
    ap.add_argument("--orders", default="ascending,shuffled")
    ap.add_argument("--ttft-tokens", type=int, default=None, help="prompt length of the TTFT run (default 8192)")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shape = TINY if args.tiny else LLAMA_8B
    default_tokens = "128,1024,4096" if args.tiny else "1024,8192,32768"
    args.tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    args.orders = args.orders.split(",")
    args.ttft_tokens = args.ttft_tokens or (1024 if args.tiny else 8192)
    if args.device == "cpu":
        import torch
        torch.set_num_threads(1)

    res = dict(shape=shape, tokens=args.tokens, orders=args.orders, reps=args.reps, num_threads=args.num_threads,
               split_batch_size=args.split_batch_size, env=environment(args))
    print(json.dumps({k: v for k, v in res["env"].items() if k != "topo"}, indent=1))
    print(res["env"].get("topo", ""), flush=True)
    block_bytes = shape["num_layers"] * 2 * shape["block_size"] * shape["num_kv_heads"] * shape["head_dim"] * 2
    res["peer_copy"] = peer_copy(args, shape, block_bytes)
    res["handoff"] = handoff(args, shape)
    for c in res["handoff"]["cases"]:
        c["ratio"] = res["peer_copy"][c["tokens"]] / c["wall_s"]  # handoff GB/s over peer-copy GB/s
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "kv_handoff_gpu.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    if not args.skip_ttft:
        try:
            res["ttft"] = ttft(args)
            res["ttft_share"] = []
            for budget, run in res["ttft"]["runs"].items():
                for mode in ("pull", "push"):
                    case = next((c for c in res["handoff"]["cases"] if c["tokens"] == args.ttft_tokens
                                 and c["order"] == "ascending" and c["mode"] == mode), None)
                    if case:
                        res["ttft_share"].append(dict(mode=mode, budget=budget, transfer_s=case["wall_s"],
                                                      share=case["wall_s"] / (run["median_s"] + case["wall_s"])))
        except Exception as exc:
            res["ttft_error"] = str(exc)
            print(f"TTFT run failed: {exc}", flush=True)
        out.write_text(json.dumps(res, indent=1, default=str))
    report(res)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
