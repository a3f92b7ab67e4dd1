"""Can Llama-3.1-8B's decode attention hide behind its projection GEMMs? A feasibility probe for issue 13.

At 192-256 decode rows the projection GEMMs sit at the H100's power cap, compute-bound at about 71% of copy
speed (docs/performance.md, M38-M39, M44), while decode attention streams the KV cache with little compute. One
layer's qkv GEMM, attention and o GEMM can be cut by KV-head groups without reading any weight twice::

    stream A:  qkv[g0] | qkv[g1] |          | o[g0] | o[g1] |        (o[g] = attn[g] @ Wo[:, g], accumulated)
    stream B:            | attn[g0] | attn[g1] |

so attention of one group runs beside the GEMMs of another. This probe times, per layer, in CUDA graphs over a
stack of layers (weights and KV larger than the L2), on the e2e workload's decode batch at step 300:

    gemm_qkvo, gemm_mlp, attn         each part alone
    serial                            qkv, attn, o, MLP on one stream (today's order)
    free_qkvo, free_mlp               attn on a second stream beside independent GEMMs: the best any overlap gets
    pipe2, pipe4                      the head-group pipeline above (2 or 4 groups) + MLP
    ... _cN                           the same with cuBLAS told to leave N SMs free (sm carveout)

    python3 benchmarks/gpu_overlap_probe.py [--layers 8] [--rows 0 (step-300 batch) | N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench_decode_kernel import BLOCK, D, copy_bandwidth, paged_layers, step300_contexts  # noqa: E402
from pdpool.kernels import decode_attention as da  # noqa: E402

H, HQ, HKV, INTER = 4096, 32, 8, 14336
DT = torch.bfloat16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=500, return_mode="median")


def graph(run):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=0, help="decode rows (0: the e2e batch at step 300)")
    ap.add_argument("--carveouts", default="0,16,32")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lens = step300_contexts()
    if args.rows:
        lens = (lens * (args.rows // len(lens) + 1))[:args.rows]
    R, NL = len(lens), args.layers
    meta, caches = paged_layers(lens, HKV, NL)
    rows = torch.arange(R, dtype=torch.int32, device=dev)
    sms = da.num_multiprocessors(dev)
    splits = da.choose_num_splits(R, HKV, sms)
    copy_bw = copy_bandwidth()

    def w(*shape):
        return torch.randn(*shape, device=dev, dtype=DT) * 0.02

    layers = [dict(qkv=w((HQ + 2 * HKV) * D, H), o=w(H, HQ * D), gu=w(2 * INTER, H), down=w(H, INTER))
              for _ in range(NL)]
    x = torch.randn(R, H, device=dev, dtype=DT)
    q = torch.randn(R, HQ, D, device=dev, dtype=DT)
    att = torch.empty_like(q)
    qkv_out = torch.empty(R, (HQ + 2 * HKV) * D, device=dev, dtype=DT)
    o_out = torch.empty(R, H, device=dev, dtype=DT)
    gu_out = torch.empty(R, 2 * INTER, device=dev, dtype=DT)
    down_out = torch.empty(R, H, device=dev, dtype=DT)
    ws_all = da.decode_workspace(R, HQ, HKV, D, splits, dev)

    def attn(layer, h0=0, h1=HKV, ws=None):
        k, v = caches[layer]
        g = HQ // HKV
        da.paged_decode(q[:, h0 * g:h1 * g], k[:, :, h0:h1], v[:, :, h0:h1], att[:, h0 * g:h1 * g],
                        meta.query_start_loc, meta.seq_lens, meta.block_tables, rows, D ** -0.5, splits,
                        ws or ws_all, da.MIN_SPLIT_TOKENS)

    def qkvo(layer):
        torch.matmul(x, layers[layer]["qkv"].t(), out=qkv_out)
        torch.matmul(att.view(R, -1), layers[layer]["o"].t(), out=o_out)

    def mlp(layer):
        torch.matmul(o_out, layers[layer]["gu"].t(), out=gu_out)
        torch.matmul(gu_out[:, :INTER], layers[layer]["down"].t(), out=down_out)

    side = torch.cuda.Stream()

    def free(gemms):
        def run():
            for i in range(NL):
                main_s = torch.cuda.current_stream()
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    attn(i)
                gemms(i)
                main_s.wait_stream(side)
        return run

    def pipeline(groups: int):
        per = HKV // groups
        gq = HQ // HKV
        wss = [da.decode_workspace(R, per * gq, per, D, splits, dev) for _ in range(groups)]
        # each group's q, k, v rows of W_qkv made contiguous (a real model permutes them once at load)
        wq = [[torch.cat([L["qkv"][g * per * gq * D:(g + 1) * per * gq * D],
                          L["qkv"][HQ * D + g * per * D:HQ * D + (g + 1) * per * D],
                          L["qkv"][(HQ + HKV) * D + g * per * D:(HQ + HKV) * D + (g + 1) * per * D]])
               for g in range(groups)] for L in layers]
        outs = [torch.empty(R, (per * gq + 2 * per) * D, device=dev, dtype=DT) for _ in range(groups)]

        def run():
            main_s = torch.cuda.current_stream()
            for i in range(NL):
                done = []
                for g in range(groups):
                    torch.matmul(x, wq[i][g].t(), out=outs[g])
                    side.wait_stream(main_s)
                    with torch.cuda.stream(side):
                        attn(i, g * per, (g + 1) * per, wss[g])
                        ev = torch.cuda.Event()
                        ev.record(side)
                    done.append(ev)
                for g in range(groups):
                    main_s.wait_event(done[g])
                    a = att[:, g * per * gq:(g + 1) * per * gq].reshape(R, -1)
                    wo = layers[i]["o"][:, g * per * gq * D:(g + 1) * per * gq * D]
                    if g == 0:
                        torch.matmul(a, wo.t(), out=o_out)
                    else:
                        o_out.addmm_(a, wo.t())
                main_s.wait_stream(side)
                mlp(i)
        return run

    def serial():
        for i in range(NL):
            torch.matmul(x, layers[i]["qkv"].t(), out=qkv_out)
            attn(i)
            torch.matmul(att.view(R, -1), layers[i]["o"].t(), out=o_out)
            mlp(i)

    # correctness of the cut: the pipeline's attention and o projection equal the whole launch's
    attn(0)
    torch.matmul(att.view(R, -1), layers[0]["o"].t(), out=o_out)
    ref_att, ref_o = att.clone(), o_out.clone()
    att.zero_()
    for groups in (2, 4):
        pipeline(groups)()
        torch.cuda.synchronize()
        # the last layer ran last: recompute layer 0's with the groups for the check
        per, gq = HKV // groups, HQ // HKV
        for g in range(groups):
            attn(0, g * per, (g + 1) * per, da.decode_workspace(R, per * gq, per, D, splits, dev))
        assert torch.equal(att, ref_att), "attention by head groups differs from the whole launch"
    print(f"rows {R}, splits {splits}, layers {NL}, copy {copy_bw / 1e12:.2f} TB/s", flush=True)

    kv_bytes = sum(lens) * 2 * HKV * D * 2
    w_qkvo = ((HQ + 2 * HKV) * D * H + H * HQ * D) * 2
    w_mlp = 3 * H * INTER * 2
    results = dict(rows=R, splits=splits, layers=NL, copy_bw=copy_bw, sms=sms, kv_bytes_per_layer=kv_bytes,
                   floors_us=dict(attn=kv_bytes / copy_bw * 1e6, qkvo=w_qkvo / copy_bw * 1e6,
                                  mlp=w_mlp / copy_bw * 1e6), times_us={})
    cases = {
        "attn": lambda: [attn(i) for i in range(NL)],
        "gemm_qkvo": lambda: [qkvo(i) for i in range(NL)],
        "gemm_mlp": lambda: [mlp(i) for i in range(NL)],
        "serial": serial,
        "free_qkvo": free(qkvo),
        "free_mlp": free(mlp),
        "pipe2": pipeline(2),
        "pipe4": pipeline(4),
    }
    for carve in [int(c) for c in args.carveouts.split(",")]:
        torch._C._set_sm_carveout_experimental(carve if carve else None)
        for name, run in cases.items():
            if carve and name in ("attn",):
                continue
            replay = graph(run)
            us = bench(replay) * 1e3 / NL
            key = name if not carve else f"{name}_c{carve}"
            results["times_us"][key] = round(us, 1)
            print(f"{key:>16}: {us:8.1f} us/layer", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    t = results["times_us"]
    print(json.dumps(results))
    print(f"serial {t['serial']:.1f} = parts {t['attn'] + t['gemm_qkvo'] + t['gemm_mlp']:.1f}; "
          f"best pipeline {min(v for k, v in t.items() if k.startswith('pipe')):.1f}; "
          f"free overlap bound qkvo {min(v for k, v in t.items() if k.startswith('free_qkvo')):.1f} "
          f"against attn + qkvo {t['attn'] + t['gemm_qkvo']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
