"""``pdpool bench``: run a benchmark against an OpenAI-compatible endpoint; ``pdpool bench compare``: plot runs
together. See docs/bench.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import urllib.parse
from pathlib import Path

import aiohttp

from pdpool.bench import client, datasets, load, plots, report, stats, vllm_result


def _positive(kind):
    """An argparse type: a number > 0 (0 or less is no load, no time, no requests: refused, not run)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


POSITIVE_INT, POSITIVE = _positive(int), _positive(float)


def _bound(text: str) -> float | None:
    """An argparse type: a number > 0, or ``inf`` for no bound (None: no Infinity in bench.json, which strict JSON
    readers refuse). ``--rate inf`` is vLLM's: every request at once."""
    value = POSITIVE(text)
    return None if math.isinf(value) else value


VLLM_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def _endpoint(text: str) -> str:
    """An argparse type: ``completions``, ``chat``, or the path that vLLM's ``--endpoint`` names."""
    return next((name for name, path in client.ENDPOINTS.items() if text == path), text)


def _backend(text: str) -> str:
    """An argparse type: vLLM's ``--backend`` -> the endpoint it speaks."""
    if text not in VLLM_BACKENDS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(sorted(VLLM_BACKENDS))}")
    return VLLM_BACKENDS[text]


def _ratio(text: str) -> float:
    """An argparse type: vLLM's ``--random-range-ratio``, in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return value


def _checked(parse):
    """An argparse type from a parser that raises ``ValueError``: its message names the flag."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return check


def _length_range(text: str) -> str:
    """An argparse type: ``N`` or ``MIN:MAX`` token lengths, checked here so that the error names the flag."""
    try:
        datasets.parse_range(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX with 1 <= MIN <= MAX") from None
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdpool bench", description="Measure an OpenAI-compatible endpoint "
                                "(`pdpool bench compare A.json B.json ... --out DIR` plots several runs together).")
    p.add_argument("--url", "--base-url", default=None,
                   help="the server's base URL, e.g. http://127.0.0.1:8000 (default: http://--host:--port)")
    p.add_argument("--host", default="127.0.0.1", help="vLLM's: the server's host, without --url")
    p.add_argument("--port", type=POSITIVE_INT, default=8000, help="vLLM's: the server's port, without --url")
    p.add_argument("--model", required=True, help="the model name sent in each request")
    p.add_argument("--endpoint", type=_endpoint, choices=sorted(client.ENDPOINTS), default="completions",
                   help="completions or chat (or vLLM's /v1/completions, /v1/chat/completions)")
    p.add_argument("--backend", type=_backend, dest="endpoint", default=argparse.SUPPRESS,
                   help="vLLM's spelling of --endpoint: openai or vllm (completions), openai-chat (chat)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--tokenizer", default=None, help="'demo' or a local model folder for token lengths "
                   "(default: --model when it is one; 'none': lengths in words)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", "--dataset-name", choices=("random", "shared-prefix", "jsonl", "sharegpt", "custom"),
                   default="random")
    g.add_argument("--dataset-path", type=Path, help="the JSONL or ShareGPT JSON file (jsonl, custom, sharegpt)")
    g.add_argument("--sharegpt-output-len", type=POSITIVE_INT, default=None,
                   help="sharegpt max_tokens (default: each conversation's second turn's length)")
    g.add_argument("--custom-output-len", type=POSITIVE_INT, default=256, help="custom: the default max_tokens")
    g.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send the prompts as they are (default: through the model's chat template)")
    g.add_argument("--disable-shuffle", action="store_true", help="custom, sharegpt: keep the file's order")
    g.add_argument("--random-input-len", type=_length_range, default="128", help="N or MIN:MAX prompt length")
    g.add_argument("--random-output-len", type=_length_range, default="64", help="N or MIN:MAX max_tokens")
    g.add_argument("--random-range-ratio", type=_ratio, default=None,
                   help="vLLM's: with a single N, lengths are drawn from [N*(1-R), N*(1+R)]")
    g.add_argument("--random-token-ids", action="store_true", help="token-id prompts instead of text")
    g.add_argument("--num-groups", type=POSITIVE_INT, default=4, help="shared-prefix: number of system prompts")
    g.add_argument("--prompts-per-group", type=POSITIVE_INT, default=8, help="shared-prefix: users per system prompt")
    g.add_argument("--system-prompt-len", type=POSITIVE_INT, default=256)
    g.add_argument("--question-len", type=POSITIVE_INT, default=32)
    g.add_argument("--output-len", type=POSITIVE_INT, default=32, help="shared-prefix max_tokens; JSONL default")
    g = p.add_argument_group("load (every run is bounded by --num-requests and --time-limit)")
    g.add_argument("--num-requests", "--num-prompts", type=POSITIVE_INT, default=None,
                   help="default: the dataset's size (random: 100); a shorter dataset is cycled")
    g.add_argument("--time-limit", type=_bound, default=600.0, help="seconds per run (inf: no limit)")
    g.add_argument("--concurrency", "--max-concurrency", type=POSITIVE_INT, default=None,
                   help="requests in flight at most")
    g.add_argument("--rate", "--request-rate", type=_bound, default=None,
                   help="Poisson arrivals at this rate (req/s); inf, the default: every request at once")
    g.add_argument("--burstiness", type=POSITIVE, default=1.0,
                   help="vLLM's: gamma-distributed gaps of this shape (1: Poisson, less: burstier)")
    g.add_argument("--sweep", default=None, help="comma-separated rates, one run each")
    g.add_argument("--request-timeout", type=_bound, default=600.0, help="seconds per request (inf: none)")
    g = p.add_argument_group("requests")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/pdpool extension)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None, help="SLOs in ms for goodput, e.g. ttft=500,tpot=100[,e2el=...]")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="vLLM's spelling of --slo: ttft:500 tpot:100 [e2el:...]")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="sweeps: report the highest rate with at least this fraction of requests within the SLOs")
    g.add_argument("--out", type=Path, default=None, help="write bench.json and the PNG plots here")
    g.add_argument("--label", default=None, help="the name of this run in plots (default: the --out folder)")
    g.add_argument("--no-progress", "--disable-tqdm", action="store_true")
    g = p.add_argument_group("vLLM's result file (vllm bench serve --save-result: its keys and file name)")
    g.add_argument("--save-result", action="store_true", help="write each run's result as vLLM does")
    g.add_argument("--result-dir", type=Path, default=Path("."), help="default: the current folder")
    g.add_argument("--result-filename", default=None,
                   help="default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    g.add_argument("--percentile-metrics", type=_checked(vllm_result.parse_metrics),
                   default=vllm_result.DEFAULT_METRICS, help="of ttft, tpot, itl, e2el; default ttft,tpot,itl")
    g.add_argument("--metric-percentiles", type=_checked(vllm_result.parse_percentiles),
                   default=vllm_result.DEFAULT_PERCENTILES, help="comma-separated, default 99")
    return p


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
    summary = stats.summarize(records, duration, slo, num_requests=len(reqs))
    return {"rate": rate, "concurrency": args.concurrency, "summary": summary, "records": records}


def run(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.url is None:  # vLLM's --host and --port, and its defaults
        args.url = f"http://{args.host}:{args.port}"
    if args.random_range_ratio is not None and ":" in args.random_input_len + args.random_output_len:
        parser.error("--random-range-ratio needs a single --random-input-len and --random-output-len N, not MIN:MAX")
    if args.goodput:
        if args.slo:
            parser.error("--slo and --goodput: give one")
        args.slo = ",".join(item.replace(":", "=", 1) for item in args.goodput)
    if args.rate is not None and args.sweep:
        parser.error("--rate and --sweep: give one (a sweep's rates are its own)")
    if args.result_filename and args.sweep:
        parser.error("--result-filename names one file; a --sweep writes one per rate: leave it out")
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
    print(report.table(label, runs))
    for line in report.failures(runs, args.time_limit):  # without --out the table never said why requests failed
        print(f"pdpool bench: {line}", file=sys.stderr)
    if sweep and slo:
        print(f"highest rate with SLO attainment >= {args.slo_attainment:g}: {sweep['max_rate_meeting_slo']}")
    if args.save_result:
        backend = "openai-chat" if args.endpoint == "chat" else "openai"
        for r in runs:
            data = vllm_result.result(r, backend=backend, label=args.label or backend, model=args.model,
                                      tokenizer=args.tokenizer, burstiness=args.burstiness,
                                      metrics=args.percentile_metrics, percentiles=args.metric_percentiles)
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
