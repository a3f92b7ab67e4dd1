"""The command line of ``pdpool bench``: its flags, with vLLM's spellings beside pdpool's (``--base-url``,
``--num-prompts``, ``--request-rate``, ...), the argparse types that check each value where it is named, and
``parse``, which also checks the flags against each other."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from pdpool.bench import client, datasets, vllm_result


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
    g.add_argument("--percentile-metrics", type=_checked(vllm_result.parse_metrics), default=None,
                   help="of ttft, tpot, itl, e2el: the table's rows (default all) and the result file's "
                   "(default ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", type=_checked(vllm_result.parse_percentiles), default=None,
                   help="comma-separated: the table's and bench.json's, with p50 (default 50,90,99), and the "
                   "result file's (default 99)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags of ``argv``, vLLM's spellings resolved (``--host``/``--port`` into ``url``, ``--goodput`` into
    ``slo``), the checks across flags done (argparse errors, exit 2)."""
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
    return args
