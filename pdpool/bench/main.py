"""``pdpool bench``: run a benchmark against an OpenAI-compatible endpoint; ``pdpool bench compare``: plot runs
together. See docs/bench.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import urllib.parse
from pathlib import Path

import aiohttp

from pdpool.bench import client, datasets, flags, load, plots, report, stats, vllm_result


def _frontend(args):
    name = args.tokenizer or args.model
    if name.lower() == "none":
        return None
    try:
        from pdpool.frontend import Frontend

        return Frontend.from_model(name)
    except Exception as exc:  # noqa: BLE001 - any failure means: no tokenizer, count words
        if args.tokenizer:
            raise SystemExit(f"pdpool bench: --tokenizer {name}: {exc}") from None
        print(f"pdpool bench: no tokenizer for {name!r} ({exc}); lengths are in words", file=sys.stderr)
        return None


def _check_reachable(url: str, timeout: float = 10.0) -> None:
    """Connect to the server once before any run: when nothing listens, say so now, not after every request of the
    run has failed on its own schedule (vLLM's bench also stops when its first request cannot be sent)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname:
            raise ValueError("no host in the URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pdpool bench: cannot connect to {url}: {exc}") from None


def _sweep_rate(text: str) -> float | None:
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--sweep: {text.strip()!r} is not a rate") from None
    if not rate > 0:
        raise ValueError(f"--sweep: rate {text.strip()} must be > 0")
    return None if math.isinf(rate) else rate


def _requests(args, lengths: datasets.Lengths, seed: int) -> list[datasets.BenchRequest]:
    if args.dataset == "random":
        num = args.num_requests or 100
        input_len, output_len = (datasets.parse_range(x) for x in (args.random_input_len, args.random_output_len))
        if args.random_range_ratio is not None:  # a single N each (checked in run)
            ratio = args.random_range_ratio
            input_len, output_len = (datasets.ratio_range(n, ratio) for n, _ in (input_len, output_len))
        return datasets.random_requests(num, input_len, output_len, lengths, seed, args.random_token_ids)
    if args.dataset == "shared-prefix":
        reqs = datasets.shared_prefix_requests(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                               args.question_len, args.output_len, lengths, seed,
                                               chat=args.endpoint == "chat")
    elif args.dataset_path is None:
        raise SystemExit(f"pdpool bench: --dataset {args.dataset} needs --dataset-path")
    elif args.dataset == "sharegpt":
        reqs = datasets.sharegpt_requests(args.dataset_path, args.num_requests or 1000, lengths, seed,
                                          args.sharegpt_output_len, shuffle=not args.disable_shuffle)
    elif args.dataset == "custom":  # vLLM's: pdpool's JSONL, templated (completions only) and shuffled by default
        reqs = datasets.jsonl_requests(args.dataset_path, args.custom_output_len, lengths)
        if not args.skip_chat_template and args.endpoint == "completions":
            reqs = datasets.chat_templated(reqs, lengths)
        if not args.disable_shuffle:
            random.Random(seed).shuffle(reqs)
    else:
        reqs = datasets.jsonl_requests(args.dataset_path, args.output_len, lengths)
    return datasets.take(reqs, args.num_requests or len(reqs))


def _sampling(args) -> dict:
    sampling: dict = {"temperature": args.temperature}
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    if args.extra_body:
        extra = json.loads(args.extra_body)  # a JSONDecodeError is a ValueError: refused by the caller
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        sampling.update(extra)
    return sampling


async def _run_one(args, reqs, bodies, rate, seed, slo, lengths, desc) -> dict:
    url = client.endpoint_url(args.url, args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    count = lengths.count if lengths.frontend is not None else None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector_limit = args.concurrency or len(reqs) or 1

    def new_record(i: int, send_time: float) -> stats.RequestRecord:
        return stats.RequestRecord(index=i, send_time=send_time, prompt_tokens=reqs[i].prompt_len,
                                   max_tokens=reqs[i].max_tokens)

    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=1 << 20,
                                     connector=aiohttp.TCPConnector(limit=connector_limit)) as session:
        async def send(i: int, send_time: float) -> stats.RequestRecord:
            return await client.send(session, url, bodies[i], new_record(i, send_time), headers, count)

        records, duration = await load.run_load(len(reqs), send, new_record, rate=rate, concurrency=args.concurrency,
                                                time_limit=args.time_limit or math.inf, seed=seed,
                                                burstiness=args.burstiness, progress=not args.no_progress, desc=desc)
    percentiles = sorted({50.0, *args.metric_percentiles}) if args.metric_percentiles else stats.PERCENTILES
    summary = stats.summarize(records, duration, slo, num_requests=len(reqs), percentiles=percentiles)
    return {"rate": rate, "concurrency": args.concurrency, "summary": summary, "records": records}


def run(argv: list[str]) -> int:
    args = flags.parse(argv)
    try:
        slo = stats.parse_slo(args.slo) if args.slo else None
        rates = [_sweep_rate(x) for x in args.sweep.split(",") if x.strip()] if args.sweep is not None else [args.rate]
        if not rates:
            raise ValueError(f"--sweep {args.sweep!r} names no rate")
        sampling = _sampling(args)
        if not 0 < args.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment {args.slo_attainment:g} must be in (0, 1]")
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {args.url!r} must start with http:// or https://")
        if args.out:  # before the run, not after it: a folder that cannot be made would lose the whole run
            args.out.mkdir(parents=True, exist_ok=True)
        if args.save_result:
            args.result_dir.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pdpool bench: {exc}") from None
    lengths = datasets.Lengths(_frontend(args))
    label = args.label or (args.out.name if args.out else f"{args.dataset} @ {args.url}")
    plans = []  # every run's requests are made before anything is sent: a bad dataset flag is refused at once
    for n, rate in enumerate(rates):
        seed = args.seed + n  # a sweep's runs get new prompts: no run profits from the cache of the one before
        try:
            reqs = _requests(args, lengths, seed)
            bodies = [client.request_body(r, args.endpoint, args.model, sampling) for r in reqs]
        except (ValueError, OSError) as exc:
            raise SystemExit(f"pdpool bench: {exc}") from None
        plans.append((rate, seed, reqs, bodies))
    _check_reachable(args.url)
    runs = [asyncio.run(_run_one(args, reqs, bodies, rate, seed, slo, lengths,
                                 "bench" if rate is None else f"rate {rate:g}/s"))
            for rate, seed, reqs, bodies in plans]
    sweep = None
    if args.sweep:
        sweep = {"rates": rates, "slo_attainment_target": args.slo_attainment,
                 "max_rate_meeting_slo": stats.max_rate_meeting_attainment(runs, args.slo_attainment) if slo else None}
    print(report.table(label, runs, args.percentile_metrics or stats.METRICS))
    for line in report.failures(runs, args.time_limit):  # without --out the table never said why requests failed
        print(f"pdpool bench: {line}", file=sys.stderr)
    if sweep and slo:
        print(f"highest rate with SLO attainment >= {args.slo_attainment:g}: {sweep['max_rate_meeting_slo']}")
    if args.save_result:
        backend = "openai-chat" if args.endpoint == "chat" else "openai"
        for r in runs:
            data = vllm_result.result(r, backend=backend, label=args.label or backend, model=args.model,
                                      tokenizer=args.tokenizer, burstiness=args.burstiness,
                                      metrics=args.percentile_metrics or vllm_result.DEFAULT_METRICS,
                                      percentiles=args.metric_percentiles or vllm_result.DEFAULT_PERCENTILES)
            print(f"wrote {vllm_result.write(data, args.result_dir, args.result_filename)}")
    if args.out:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
        config["length_unit"] = lengths.unit
        data = report.result(label, config, runs, sweep)
        path = report.write_result(data, args.out)
        try:
            pngs = plots.plot_results([report.read_result(path)], args.out)
        except plots.PlotsUnavailable as exc:  # the run succeeded and its result is written: say so, exit as it went
            print(f"wrote {path}")
            print(f"pdpool bench: no plots: {exc}", file=sys.stderr)
        else:
            print(f"wrote {path} and {', '.join(p.name for p in pngs)}")
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdpool bench compare", description="Plot several bench results together.")
    p.add_argument("results", nargs="+", type=Path, help="bench.json files (or the --out folders holding them)")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        path = path / report.RESULT_FILE if path.is_dir() else path
        try:
            results.append(report.read_result(path))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"pdpool bench compare: {exc}") from None
    labels = [r["label"] for r in results]
    if len(set(labels)) < len(labels):  # same labels: tell them apart by their files
        for data, path in zip(results, args.results):
            data["label"] = f"{data['label']} ({path})"
    for data in results:
        print(report.table(data["label"], data["runs"]))
    try:
        pngs = plots.plot_results(results, args.out)
    except plots.PlotsUnavailable as exc:
        raise SystemExit(f"pdpool bench compare: no plots: {exc}") from None
    print(f"wrote {', '.join(str(p) for p in pngs)}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    return run(argv)
