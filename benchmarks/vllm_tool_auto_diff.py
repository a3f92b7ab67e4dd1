"""tool_choice "auto": `pdpool serve` against `vllm serve` (0.32, CPU build), both with
`--enable-auto-tool-choice --tool-call-parser NAME`, on the demo model (SmolLM2-135M-Instruct, float32, greedy).

Per parser (hermes, llama3_json, pythonic), the same requests go to each server, whole and streamed, through raw
HTTP: a plain question (the model answers in text), few-shot prompts in the parser's format that make the greedy
model call a tool (one call; two calls, also with parallel_tool_calls false; one cut by max_tokens), tool_choice
"none" on the same prompt, and auto without tools. Each answer is reduced to what a client reads: status (and
error param), finish_reason, content, the calls (name, arguments as JSON), and for streams the delta layout (chunks
with tool_calls, argument pieces per call, content after the first call). The report lists every difference.

Benchmark-only: vLLM comes from its own venv (benchmarks/online_serve.py says how it is set up); peers start with
cwd=/tmp. One server runs at a time.

    .venv/bin/python benchmarks/vllm_tool_auto_diff.py [--parsers hermes,llama3_json,pythonic] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_serve import DEFAULT_VLLM_VENV, start_demo_server, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def rendered(parser: str, cities: list[str]) -> str:
    if parser == "hermes":
        return "\n".join('<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % c
                         for c in cities)
    if parser == "llama3_json":
        return "; ".join('{"name": "get_weather", "parameters": {"city": "%s"}}' % c for c in cities)
    return "[" + ", ".join('get_weather(city="%s")' % c for c in cities) + "]"


def few_shot(parser: str, asks: list[list[str]]) -> list[dict]:
    messages = [{"role": "system", "content": "You answer only with tool calls."}]
    for cities in asks[:-1]:
        messages += [{"role": "user", "content": f"Weather in {' and '.join(cities)}?"},
                     {"role": "assistant", "content": rendered(parser, cities)}]
    return messages + [{"role": "user", "content": f"Weather in {' and '.join(asks[-1])}?"}]


def cases(parser: str) -> dict[str, dict]:
    one = few_shot(parser, [["Paris"], ["Rome"], ["Berlin"]])
    two = few_shot(parser, [["Paris", "Rome"], ["Oslo", "Bern"], ["Berlin", "Madrid"]])
    base = {"model": "demo", "temperature": 0, "max_tokens": 64}
    return {
        "plain text, tools (default auto)": {**base, "messages": [{"role": "user", "content":
                                                                   "What is the weather in Paris?"}], "tools": TOOLS},
        "one call": {**base, "messages": one, "tools": TOOLS, "tool_choice": "auto"},
        "two calls": {**base, "messages": two, "tools": TOOLS},
        "two calls, parallel_tool_calls false": {**base, "messages": two, "tools": TOOLS,
                                                 "parallel_tool_calls": False},
        "call cut by max_tokens": {**base, "messages": one, "tools": TOOLS, "max_tokens": 12},
        "tool_choice none": {**base, "messages": one, "tools": TOOLS, "tool_choice": "none"},
        "auto without tools": {**base, "messages": one, "tool_choice": "auto"},
    }


def whole(http: httpx.Client, url: str, body: dict) -> dict:
    r = http.post(url + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        return {"status": r.status_code, "error param": (r.json().get("error") or {}).get("param")}
    choice = r.json()["choices"][0]
    message = choice["message"]
    return {"status": 200, "finish_reason": choice["finish_reason"], "content": message.get("content"),
            "tool_calls key": "tool_calls" in message,
            "calls": [(c["function"]["name"], _args(c["function"]["arguments"])) for c in message.get("tool_calls")
                      or []]}


def _args(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return f"NOT JSON: {text!r}"


def streamed(http: httpx.Client, url: str, body: dict) -> dict:
    with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code}
        content, calls, finish, tool_chunks, content_after_call = "", {}, None, 0, False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                if delta.get("content"):
                    content += delta["content"]
                    content_after_call |= bool(calls)
                if delta.get("tool_calls"):
                    tool_chunks += 1
                for t in delta.get("tool_calls") or []:
                    call = calls.setdefault(t["index"], {"name": None, "pieces": []})
                    function = t.get("function") or {}
                    if function.get("name"):
                        call["name"] = function["name"]
                    if function.get("arguments"):
                        call["pieces"].append(function["arguments"])
                finish = c.get("finish_reason") or finish
    return {"status": 200, "finish_reason": finish, "content": content, "chunks with tool_calls": tool_chunks,
            "content after a call": content_after_call,
            "calls": [(c["name"], _args("".join(c["pieces"]))) for _, c in sorted(calls.items())],
            "argument pieces": [len(c["pieces"]) for _, c in sorted(calls.items())]}


def run(url: str, parser: str) -> dict:
    out = {}
    with httpx.Client(timeout=300) as http:
        for name, body in cases(parser).items():
            out[name] = {"whole": whole(http, url, body), "stream": streamed(http, url, body)}
            print(f"  {name}: {out[name]['whole']}", flush=True)
    return out


def start(engine: str, parser: str, vllm_venv: str, model: str, log_dir: Path):
    auto = ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    return start_demo_server(engine, vllm_venv, model, log_dir / f"{engine}-{parser}.log", threads=THREADS,
                             max_model_len=1024, pdpool_args=auto, vllm_args=auto)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    ap.add_argument("--parsers", default="hermes,llama3_json,pythonic")
    ap.add_argument("--only", default="pdpool,vllm")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pdpool.models.demo import resolve_model

    model = str(resolve_model("demo"))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="tool-auto-diff-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for parser in args.parsers.split(","):
        for engine in args.only.split(","):
            saved = out_dir / f"{engine}-{parser}.json"
            if saved.exists():
                results[(engine, parser)] = json.loads(saved.read_text())
                continue
            proc, url = start(engine, parser, args.vllm_venv, model, out_dir)
            try:
                print(f"--- {engine} {parser} at {url}", flush=True)
                results[(engine, parser)] = json.loads(json.dumps(run(url, parser)))
            finally:
                stop(proc)
            saved.write_text(json.dumps(results[(engine, parser)], indent=1))
    print(f"\n(results and logs in {out_dir})")
    for parser in args.parsers.split(","):
        p, v = results.get(("pdpool", parser)), results.get(("vllm", parser))
        if p is None or v is None:
            continue
        print(f"\n## {parser}")
        for name in p:
            for mode in ("whole", "stream"):
                a, b = p[name][mode], v[name][mode]
                keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
                same = "same" if not keys else "DIFFERENT"
                print(f"  {name} [{mode}]: {same}" + ("" if keys else f"  {a}"))
                for k in keys:
                    print(f"      {k}: pdpool {a.get(k)!r} | vllm {b.get(k)!r}")


if __name__ == "__main__":
    main()
