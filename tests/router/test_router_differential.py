"""Differential property: the router's answer to a request equals a colocated node's, whatever its options.

Hypothesis draws a valid ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/messages`` body from the options
that take special paths (prompt forms, echo, ``max_tokens`` 0 with echo, logprobs, ``prompt_logprobs``, ``truncate_prompt_tokens``,
stop strings and ids, ``ignore_eos``, ``min_tokens``, ``logit_bias``, ``n``, streaming with usage,
``return_token_ids``, seeded sampling, structured output) and sends it first to the router (1 prefill + 2 decode real nodes, real
Redis and NIXL, the demo model on CPU) and then, as it is, to the decode node ``d0``, which serves a request
without ``kv_transfer_params`` end to end. Every prompt ends in drawn words, so most are new to the decode nodes
and the router hands them off (prefill on ``p0``, KV over NIXL, decode on ``d0``/``d1``); prompt-logprob and
several-prompt or ``n`` > 1 requests go decode-only.

Compared (streams reassembled per choice, both sides streamed alike): status, error body, texts, token ids,
finish and stop reasons, usage counts, logprob tokens and top-N keys, and logprob values within 1e-3 (the prefix
cache changes the float order of attention slightly). Not compared: ids, ``created`` and ``cached_tokens`` (they
depend on the request and the cache state); chat's top_logprobs lists are compared as sets (near-equal entries
may swap). Also: the handoff ran at least once, no prefill leg fell back, and every node has its blocks back and
no lease at the end. ``PDPOOL_DIFF_EXAMPLES`` (default 25) sets the example count (times 10 under the explore
profile).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from hypothesis_profiles import scaled
from cluster import assert_no_leaks
from routers import redis_flags

pytestmark = pytest.mark.timeout(600)

DISAGGREGATED = 'pdpool_router_requests_total{decision="disaggregated"}'
DECODE_ONLY = 'pdpool_router_requests_total{decision="decode_only"}'
FALLBACK = 'pdpool_router_requests_total{decision="fallback"}'
TOLERANCE = 1e-3
IGNORED = {"id", "created", "created_at", "cached_tokens"}

# Each base is >= 2 blocks of 16 tokens; the drawn tail makes most prompts new to the decode nodes.
BASES = (
    "The history of the city begins with a small fishing village on the river, where traders from the north met "
    "farmers from the valley every spring to exchange wool, salt and stories.",
    "A long report about bridges starts with its history, then describes the people who worked on it, the places "
    "where it happened and the results that were published over the following years.",
    "Write a short poem about the sea at night, the lights of the harbor, the boats that come home late and the "
    "old lighthouse keeper who counts them one by one.",
)
WORDS = "river mountain lantern harbor violet copper meadow falcon orchard glacier pepper saddle thunder".split()
# SmolLM2 ids: ',' 28, '.' 30, ' the' 260, ' and' 284, ' of' 282, ' a' 253, '\n' 198, ' is' 314, ' to' 288,
# ' in' 281, ' river' 4626, ' city' 2240; <|im_end|> (EOS) 2
COMMON_IDS = (28, 30, 260, 284, 282, 253, 198, 314, 288, 281, 4626, 2240, 2)
STOPS = (",", ".", " the", "e", "\n", " and", "a")
CONSTRAINTS = ({"regex": "[a-z ]{1,40}"}, {"choice": ["river", "harbor lights", "copper"]}, {"json_object": True},
               {"json": {"type": "object", "required": ["word"], "properties": {"word": {"enum": WORDS[:5]}}}},
               {"grammar": 'start: "The " WORD\nWORD: "river" | "harbor"', "disable_any_whitespace": True})


def _text(draw) -> str:
    tail = " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4)))
    return f"{draw(st.sampled_from(BASES))} {tail}"


@st.composite
def requests(draw) -> tuple[str, dict]:
    """(path, body): a valid request; ``{"ids": text}`` stands for the ids of ``text`` (made by the test)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(responses_requests() if draw(st.booleans()) else messages_requests())
    chat = draw(st.booleans())
    body: dict = {"model": "demo"}
    if draw(st.integers(0, 3)) == 0:   # seeded sampling: the router's answer is still the node's
        body["temperature"] = draw(st.sampled_from([0.7, 1.0, 1.5]))
        body["seed"] = draw(st.integers(0, 2**31))
        if draw(st.booleans()):
            body["top_p"] = 0.9
    else:
        body["temperature"] = 0
    if chat:
        path = "/v1/chat/completions"
        messages = [{"role": "user", "content": _text(draw)}]
        if draw(st.booleans()):
            messages.insert(0, {"role": "system", "content": "You answer briefly."})
        body["messages"] = messages
        if draw(st.integers(0, 3)) == 0:   # the answer goes on from an assistant's start, echoed or not
            messages.append({"role": "assistant", "content": draw(st.sampled_from(["The answer is", "Sure,"]))})
            body["add_generation_prompt"] = False
            if draw(st.booleans()):
                body["continue_final_message"] = True
            body["echo"] = draw(st.booleans())
        if draw(st.integers(0, 4)) == 0:   # read by templates that know them; the router renders as the node
            body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
        max_tokens = draw(st.integers(1, 6))
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = max_tokens
        if draw(st.booleans()):
            body["logprobs"] = True
            if draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 3))
    else:
        path = "/v1/completions"
        form = draw(st.sampled_from(["text", "ids", "texts", "one-text-list"]))
        if form == "text":
            body["prompt"] = _text(draw)
        elif form == "ids":
            body["prompt"] = {"ids": _text(draw)}
        elif form == "texts":
            body["prompt"] = [_text(draw), _text(draw)]
        else:
            body["prompt"] = [_text(draw)]
        echo = draw(st.booleans())
        if echo:
            body["echo"] = True
        max_tokens = draw(st.integers(0 if echo else 1, 6))
        body["max_tokens"] = max_tokens
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)) == 0:
        body["truncate_prompt_tokens"] = draw(st.one_of(st.just(-1), st.integers(1, 60)))
    if draw(st.booleans()):
        body["stop"] = draw(st.one_of(st.sampled_from(STOPS), st.lists(st.sampled_from(STOPS), min_size=1,
                                                                       max_size=2)))
    if draw(st.integers(0, 3)) == 0:
        body["stop_token_ids"] = draw(st.lists(st.sampled_from(COMMON_IDS), min_size=1, max_size=3))
    if draw(st.booleans()):
        body["ignore_eos"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        body["min_tokens"] = draw(st.integers(0, max(max_tokens, 0)))
    if draw(st.integers(0, 3)) == 0:
        body["logit_bias"] = draw(st.dictionaries(st.sampled_from(COMMON_IDS).map(str),
                                                  st.sampled_from([-100, -5, -0.5, 2.5, 8, 100]),
                                                  min_size=1, max_size=3))
    if draw(st.integers(0, 3)) == 0:   # structured output: the decode node's grammar goes on from the prefill's token
        body["structured_outputs"] = draw(st.sampled_from(CONSTRAINTS))
    if draw(st.integers(0, 3)) == 0:
        body["n"] = 2
    if draw(st.booleans()):
        body["return_token_ids"] = True
    if draw(st.integers(0, 3)) == 0:
        body["return_tokens_as_token_ids"] = True
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    return path, body


@st.composite
def responses_requests(draw) -> tuple[str, dict]:
    """A /v1/responses body: the input as a string or items (with instructions, an earlier turn), and the options
    it passes on to chat."""
    body: dict = {"model": "demo", "temperature": 0, "max_output_tokens": draw(st.integers(1, 6))}
    if draw(st.booleans()):
        body["input"] = _text(draw)
    else:
        body["input"] = [{"role": "user", "content": [{"type": "input_text", "text": _text(draw)}]}]
        if draw(st.booleans()):
            body["input"][:0] = [{"role": "user", "content": "Hi"},
                                 {"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": "Hello."}]}]
    if draw(st.booleans()):
        body["instructions"] = "You answer briefly."
    if draw(st.integers(0, 3)) == 0:
        body.update(temperature=draw(st.sampled_from([0.7, 1.0])), seed=draw(st.integers(0, 2**31)))
    if draw(st.booleans()):
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["stop"] = draw(st.sampled_from(STOPS))
    if draw(st.integers(0, 3)) == 0:
        body["logit_bias"] = {str(draw(st.sampled_from(COMMON_IDS))): draw(st.sampled_from([-100, 8]))}
    if draw(st.integers(0, 3)) == 0:
        body["text"] = {"format": draw(st.sampled_from([
            {"type": "json_object"},
            {"type": "json_schema", "name": "w", "schema": CONSTRAINTS[3]["json"]}]))}
    if draw(st.booleans()):
        body["stream"] = True
    return "/v1/responses", body


@st.composite
def messages_requests(draw) -> tuple[str, dict]:
    """A /v1/messages body (Anthropic's): a string or text blocks (with system, an earlier turn), and the options it
    passes on to chat."""
    body: dict = {"model": "demo", "temperature": 0, "max_tokens": draw(st.integers(1, 6))}
    text = _text(draw)
    body["messages"] = [{"role": "user", "content": text if draw(st.booleans()) else [{"type": "text", "text": text}]}]
    if draw(st.booleans()):
        body["messages"][:0] = [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]
    if draw(st.booleans()):
        body["system"] = draw(st.sampled_from(["You answer briefly.", [{"type": "text", "text": "Be brief."}]]))
    if draw(st.integers(0, 3)) == 0:   # greedy only: a Messages body has no seed to sample reproducibly with
        body["top_k"] = draw(st.sampled_from([1, 5]))
    if draw(st.booleans()):
        body["stop_sequences"] = [draw(st.sampled_from(STOPS))]
    if draw(st.booleans()):
        body["stream"] = True
    return "/v1/messages", body


# ---- sending and reassembling ---------------------------------------------------------------------------------

def _resolve(body: dict, node_url: str) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, dict):
        r = httpx.post(node_url + "/tokenize", json={"prompt": prompt["ids"]}, timeout=30)
        assert r.status_code == 200, r.text
        body = {**body, "prompt": r.json()["tokens"]}
    return body


def _merge(dst: dict, src: dict) -> None:
    """One stream chunk's choice into the reassembled choice: texts concatenated, lists extended, dicts merged,
    other values the latest non-null one."""
    for key, value in src.items():
        old = dst.get(key)
        if value is None:
            dst.setdefault(key, None)
        elif isinstance(value, str) and key in ("text", "content") and isinstance(old, str):
            dst[key] = old + value
        elif isinstance(value, list) and isinstance(old, list):
            old.extend(value)
        elif isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        else:
            dst[key] = json.loads(json.dumps(value))   # a copy: later chunks extend it in place


def _reassemble(lines: list[str]) -> dict:
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", lines[-5:]
    out: dict = {"choices": {}}
    for event in events[:-1]:
        obj = json.loads(event)
        for key, value in obj.items():
            if key == "choices":
                for choice in value:
                    _merge(out["choices"].setdefault(choice["index"], {}), choice)
            elif key == "object":
                continue   # chunk objects; the other side's are the same
            elif value is not None or key not in out:
                out[key] = value
    out["choices"] = [out["choices"][i] for i in sorted(out["choices"])]
    return out


def _reassemble_response(lines: list[str]) -> dict:
    """A Responses stream: its completed response, and its deltas joined (checked against it by the caller)."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", lines[-3:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    response = events[-1]["response"]
    assert deltas == "".join(c["text"] for o in response["output"] if o["type"] == "message" for c in o["content"])
    return {**events[-1]["response"], "deltas": deltas}


def _reassemble_message(lines: list[str]) -> dict:
    """A Messages stream: message_start's message with its text deltas joined, message_delta's stop and usage."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", lines[-3:]
    message = events[0]["message"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    message["content"] = [{"type": "text", "text": text}]
    delta = next(e for e in events if e["type"] == "message_delta")
    return {**message, **delta["delta"], "usage": delta["usage"]}


def _message_usage(body: dict) -> dict:
    """A Message's usage as one count: input_tokens net of the prefix-cache hits differs with the node's cache."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if isinstance(usage, dict) and "cache_read_input_tokens" in usage:
        usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    return body


def send(url: str, body: dict) -> tuple[int, dict]:
    if body.get("stream"):
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            lines = list(r.iter_lines())
            if url.endswith("/messages"):
                return 200, _message_usage(_reassemble_message(lines))
            return 200, _reassemble_response(lines) if url.endswith("/responses") else _reassemble(lines)
    r = httpx.post(url, json=body, timeout=120)
    return r.status_code, _message_usage(r.json()) if url.endswith("/messages") else r.json()


# ---- comparing --------------------------------------------------------------------------------------------------

def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _normalize(x, key: str | None = None):
    if isinstance(x, dict):
        return {k: _normalize(v, k) for k, v in x.items() if k not in IGNORED}
    if isinstance(x, list):
        items = [_normalize(v) for v in x]
        # Chat's top_logprobs are a list sorted by logprob: two near-equal entries may swap between the two sides
        # (float order). Their set is what must match.
        if key == "top_logprobs" and all(isinstance(v, dict) and "token" in v for v in items):
            items.sort(key=lambda v: (v["token"], v.get("logprob") or 0.0))
        return items
    return x


def differences(a, b, path: str = "$") -> list[str]:
    if _is_number(a) and _is_number(b) and (isinstance(a, float) or isinstance(b, float)):
        if math.isfinite(a) and math.isfinite(b):
            return [] if abs(a - b) <= TOLERANCE else [f"{path}: {a!r} != {b!r}"]
        return [] if a == b else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}: keys {sorted(set(a) ^ set(b))} on one side only"] if set(a) != set(b) else []
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}: {a!r:.300} vs {b!r:.300}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {a!r:.200} != {b!r:.200}"]


# ---- the property ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    return start_router(redis_flags(redis_module.url), name="router-differential")


def test_router_answers_as_a_colocated_node(cluster, router):
    start = {name: n.kv()["free"] for name, n in cluster.items()}
    node = cluster["d0"]
    before = {d: router.value(d) for d in (DISAGGREGATED, DECODE_ONLY, FALLBACK)}
    seen: Counter = Counter()
    fallbacks: list[dict] = []

    @settings(max_examples=scaled(int(os.environ.get("PDPOOL_DIFF_EXAMPLES", "25"))), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests())
    # Found by this property: the router forwarded only the ids truncate_prompt_tokens keeps, and the node took
    # them for the whole prompt, so echo returned the body's whole text (a node alone echoes the kept ids' text).
    @example(("/v1/completions", {"model": "demo", "temperature": 0, "prompt": BASES[0] + " river", "echo": True,
                                  "max_tokens": 0, "prompt_logprobs": 0, "truncate_prompt_tokens": 1,
                                  "stop_token_ids": [28], "min_tokens": 0, "logit_bias": {"28": -100}, "n": 2}))
    def router_equals_node(case):
        path, body = case
        body = _resolve(body, node.url)
        decisions = {d: router.value(d) for d in (DISAGGREGATED, DECODE_ONLY, FALLBACK)}
        mine_status, mine = send(router.url + path, body)
        decision = next((d.split('"')[1] for d in decisions if router.value(d) > decisions[d]), "none")
        seen[decision] += 1
        if decision == "fallback":
            fallbacks.append(body)
        theirs_status, theirs = send(node.url + path, body)
        kind = "chat" if "chat" in path else "responses" if "responses" in path else "messages" if "messages" in path \
            else "completions"
        seen[f"{kind} {'stream' if body.get('stream') else 'whole'} {theirs_status}"] += 1
        assert mine_status == theirs_status, (body, mine, theirs)
        diff = differences(_normalize(mine), _normalize(theirs))
        assert not diff, (json.dumps(body), diff[:10])

    router_equals_node()
    after = {d: router.value(d) - before[d] for d in before}
    print(f"\nexamples: {dict(seen)}; router decisions: {after}; fallbacks: {fallbacks}")
    assert after[DISAGGREGATED] >= 1, after   # the handoff path was exercised
    assert not fallbacks, fallbacks           # no prefill leg refused or failed (min_tokens > 1 was refused)
    assert_no_leaks(cluster.values(), start, 30)


def test_echo_of_a_truncated_prompt_is_the_kept_ids_text(cluster, router):
    """The router hashes the ids ``truncate_prompt_tokens`` keeps but forwards the whole prompt's, which the node
    cuts as it cuts a client's: echo's text is then the kept ids' (it was the body's whole prompt, the node
    taking the forwarded kept ids for the whole prompt). Handed off and decode-only."""
    for i, extra in enumerate(({"max_tokens": 2}, {"max_tokens": 0, "logprobs": 1})):
        body = {"model": "demo", "prompt": f"{BASES[1]} {WORDS[i]} {WORDS[-i]}", "echo": True, "temperature": 0,
                "truncate_prompt_tokens": 5, "return_token_ids": True, **extra}
        mine, theirs = (httpx.post(url + "/v1/completions", json=body, timeout=60) for url in (router.url,
                                                                                            cluster["d0"].url))
        assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
        got, want = mine.json()["choices"][0], theirs.json()["choices"][0]
        assert len(want["prompt_token_ids"]) == 5 and not BASES[1].startswith(want["text"][:20])
        assert got["text"] == want["text"] and got["prompt_token_ids"] == want["prompt_token_ids"], (got, want)


def test_min_tokens_above_one_is_handed_off(cluster, router):
    """The prefill leg asks for one token: with the client's min_tokens (> 1) it was the prefill node's 400, and
    the request fell back to decode-only. It asks for min_tokens 1 now, and the decode node's answer is still a
    colocated node's (EOS and stop ids masked for the first min_tokens tokens, the prefill's one included)."""
    body = {"model": "demo", "prompt": f"{BASES[2]} Four at least: {WORDS[3]}", "max_tokens": 5,
            "min_tokens": 4, "stop_token_ids": list(COMMON_IDS), "temperature": 0, "return_token_ids": True}
    before = {d: router.value(d) for d in (DISAGGREGATED, FALLBACK)}
    mine = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert {d: router.value(d) - before[d] for d in before} == {DISAGGREGATED: 1, FALLBACK: 0}
    theirs = httpx.post(cluster["d0"].url + "/v1/completions", json=body, timeout=60)
    assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
    assert not differences(_normalize(mine.json()), _normalize(theirs.json()))
