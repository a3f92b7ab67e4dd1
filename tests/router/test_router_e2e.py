"""The router in front of real nodes (1 prefill + 2 decode, real Redis and NIXL, the demo model on CPU).

Tests run in file order: the destructive ones (Redis down, killed nodes) come last.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest

import pdpool

from cluster import INTERNAL_TOKEN, completion_body, token_ids, wait_for  # noqa: F401
from routers import redis_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # fuzz_strategies

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three colors."}]
PROMPT = ("The history of the city begins with a small fishing village on the river, where traders from the north "
          "met farmers from the valley every spring to exchange wool, salt and stories.")


@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    return start_router(redis_flags(redis_module.url), name="router-main")


def free_blocks(cluster) -> dict[str, float]:
    return {name: node.kv()["free"] for name, node in cluster.items()}


def wait_no_leaks(cluster, start: dict[str, float], timeout: float = 10.0) -> None:
    for name, node in cluster.items():
        if node.alive:
            wait_for(lambda: (lambda kv: kv["free"] == start[name] and kv["leases"] == 0)(node.kv()), timeout,
                     f"{name} to return to {start[name]} free blocks and no lease: {node.kv()}")


# ---- output equivalence ---------------------------------------------------------------------------------

def test_openai_client_output_matches_a_colocated_node(cluster, router):
    colocated = cluster["p0"]  # a request without kv_transfer_params is served end to end on any role
    import openai

    ref = openai.OpenAI(base_url=colocated.base_url, api_key="unused", max_retries=0, timeout=120)
    client = router.client()
    before = (router.value('pdpool_router_requests_total{decision="disaggregated"}')
              + router.value('pdpool_router_requests_total{decision="decode_only"}'))
    want = ref.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.prompt_tokens_details is not None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == want
    want_chat = ref.chat.completions.create(model="demo", messages=CHAT, max_tokens=12,
                                            temperature=0).choices[0].message.content
    assert client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12,
                                          temperature=0).choices[0].message.content == want_chat
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # A prompt whose every token a decode node already holds goes decode-only (nothing left to prefill).
    routed = (router.value('pdpool_router_requests_total{decision="disaggregated"}')
              + router.value('pdpool_router_requests_total{decision="decode_only"}'))
    assert routed == before + 4  # the router served 4 of the 5 requests above (the others went to the node)
    assert router.value('pdpool_router_requests_total{decision="disaggregated"}') >= 2


def test_usage_chunk_only_when_asked(router):
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        obj = json.loads(e)
        assert "usage" not in obj and obj["choices"], obj


def test_request_id_travels_and_is_echoed(router):
    r = router.post("/v1/completions", completion_body(PROMPT, 3), headers={"X-Request-Id": "trace-abc-123"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "trace-abc-123"
    assert "trace-abc-123" in router.log_tail(20000)
    generated = router.post("/v1/completions", completion_body(PROMPT, 3)).headers["X-Request-Id"]
    assert len(generated) >= 16


def test_models_health_openapi_metrics(router):
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "demo"
    assert router.client().models.retrieve("demo").id == "demo"          # the openai client's retrieve
    missing = httpx.get(router.url + "/v1/models/meta-llama/Other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.post(router.url + "/v1/models/demo").status_code == 405
    assert httpx.get(router.url + "/health/live").status_code == 200
    assert httpx.get(router.url + "/health/ready").status_code == 200
    spec = httpx.get(router.url + "/openapi.json").json()
    assert set(spec["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                                  "/v1/models/{model}", "/v1/messages", "/v1/messages/count_tokens",
                                  "/health/live", "/health/ready", "/metrics", "/openapi.json", "/tokenize",
                                  "/detokenize", "/version"}
    assert httpx.get(router.url + "/version").json() == {"version": pdpool.__version__}   # vLLM's route, no key
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["max_tokens"]["type"] == ["integer", "null"]   # null: the rest of the context
    router.client().completions.create(model="demo", prompt="metrics", max_tokens=1)   # a decision, also alone
    m = router.metrics()
    assert m['pdpool_router_index_mode{mode="precise"}'] == 1
    assert m["pdpool_router_decision_seconds_count"] > 0
    assert m['pdpool_router_prefix_predicted_hit_tokens_total{role="prefill"}'] >= 0


def test_tokenize_and_detokenize_as_a_node_answers(cluster, router):
    """vLLM's /tokenize and /detokenize, answered by the router's own front end: the same as a node's."""
    node = cluster["d0"].url
    for body in ({"prompt": PROMPT, "return_token_strs": True}, {"model": "demo", "messages": CHAT},
                 {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}):
        mine, theirs = httpx.post(router.url + "/tokenize", json=body), httpx.post(node + "/tokenize", json=body)
        assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
        assert mine.json() == theirs.json()
    ids = httpx.post(router.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    chat_ids = httpx.post(router.url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    usage = router.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=1).usage
    assert usage.prompt_tokens == len(chat_ids)          # what the chat endpoint prompts
    assert httpx.post(router.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    bad = httpx.post(router.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(router.url + "/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert httpx.get(router.url + "/tokenize").status_code == 405


def test_echo_with_logprobs_is_scored_on_one_node(cluster, router):
    """lm-eval's scoring call (echo, logprobs, max_tokens 0) needs the whole prompt's logits on one node: the
    router sends it decode-only, and its answer is a node's."""
    body = {"model": "demo", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    disagg = router.value('pdpool_router_requests_total{decision="disaggregated"}')
    mine = router.post("/v1/completions", body)
    assert mine.status_code == 200, mine.text
    theirs = httpx.post(cluster["d0"].base_url + "/completions", json=body, timeout=60).json()
    got, want = mine.json()["choices"][0], theirs["choices"][0]
    assert got["text"] == want["text"] == PROMPT and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][0] is None
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert router.value('pdpool_router_requests_total{decision="disaggregated"}') == disagg


def test_truncate_prompt_tokens_is_the_nodes_answer(cluster, router):
    """The router keeps the same last k ids it forwards (and hashes), so its answer is a node's."""
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 20,
            "return_token_ids": True}
    mine = router.post("/v1/completions", body)
    assert mine.status_code == 200, mine.text
    theirs = httpx.post(cluster["d0"].base_url + "/completions", json=body, timeout=60).json()
    assert mine.json()["choices"][0]["prompt_token_ids"] == theirs["choices"][0]["prompt_token_ids"]
    assert len(theirs["choices"][0]["prompt_token_ids"]) == 20
    assert mine.json()["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
    bad = router.post("/v1/completions", {**body, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"



def disaggregated_and_colocated(cluster, router, path: str, body: dict) -> tuple[dict, dict]:
    """The router's whole answer to ``body`` (asserted 200 and handed off) and a colocated node's (d0's)."""
    disagg = router.value('pdpool_router_requests_total{decision="disaggregated"}')
    mine = router.post(path, body)
    assert mine.status_code == 200, mine.text
    assert router.value('pdpool_router_requests_total{decision="disaggregated"}') == disagg + 1
    return mine.json(), httpx.post(cluster["d0"].base_url + path.removeprefix("/v1"), json=body, timeout=60).json()


def test_structured_output_holds_across_the_handoff(cluster, router):
    """The prefill node samples the first token under the grammar; the decode node's matcher starts from that
    token: a schema-valid object, and the same one a colocated node gives."""
    schema = {"type": "object", "required": ["colour"], "additionalProperties": False,
              "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}}}
    body = {"model": "demo", "prompt": PROMPT + " Its flag's colour as JSON:", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}}
    mine, theirs = disaggregated_and_colocated(cluster, router, "/v1/completions", body)
    got = mine["choices"][0]
    assert got["finish_reason"] == "stop" and got["text"] == theirs["choices"][0]["text"]
    assert json.loads(got["text"])["colour"] in ("red", "green", "blue")


def test_structural_tag_holds_across_the_handoff(cluster, router):
    """vLLM's structural tag through the router (parsed there by the shared front end): free text, then after the
    trigger the tagged JSON; the same answer a colocated node gives, the segment valid."""
    flag = {"type": "object", "required": ["ok"], "additionalProperties": False,
            "properties": {"ok": {"type": "boolean"}}}
    body = {"model": "demo", "prompt": "Write a JSON object with a boolean field ok. The object", "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "structural_tag", "triggers": ["JSON"],
                                                  "structures": [{"begin": "JSON=", "schema": flag, "end": ";"}]}}
    mine, theirs = disaggregated_and_colocated(cluster, router, "/v1/completions", body)
    text = mine["choices"][0]["text"]
    assert text == theirs["choices"][0]["text"]
    segment = text[text.index("JSON=") + 5:text.index(";", text.index("JSON="))]
    assert isinstance(json.loads(segment)["ok"], bool), text


def test_tool_calls_hold_across_the_handoff(cluster, router):
    """tool_choice "required" and a named function through the router: the prefill node samples the first token
    under the tools' schema, the decode node goes on and reads the calls back; the same calls a colocated node
    makes, whole and streamed."""
    weather = {"type": "object", "required": ["city"], "additionalProperties": False,
               "properties": {"city": {"type": "string", "maxLength": 16}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "additionalProperties": False, "properties": {"tz": {"type": "string",
                                                                                     "maxLength": 8}}}}}]
    for tool_choice, finish in (("required", "tool_calls"),
                                ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        body = {"model": "demo", "messages": [{"role": "user", "content": PROMPT + " What is the weather there?"}],
                "max_tokens": 80, "temperature": 0, "tools": tools, "tool_choice": tool_choice}
        mine, theirs = disaggregated_and_colocated(cluster, router, "/v1/chat/completions", body)
        got = mine["choices"][0]
        assert got["finish_reason"] == finish and got["message"]["content"] == "", (got, theirs)
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["message"]["tool_calls"]]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in theirs["choices"][0]["message"]["tool_calls"]]
        for name, arguments in calls:
            if name == "get_weather":
                assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        streamed = router.post("/v1/chat/completions", {**body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        names, arguments, last = {}, {}, None
        for line in streamed.text.splitlines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for d in choice["delta"].get("tool_calls") or ():
                    names[d["index"]] = d["function"].get("name") or names.get(d["index"])
                    arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
                last = choice["finish_reason"] or last
        assert last == finish
        assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls


# ---- the API surface ------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"model": "demo"}, 400, "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "demo", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "pdpool_prompt_token_ids": [[1]]}, 400,
     "pdpool_prompt_token_ids"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_objekt"}}, 400, "response_format"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "structured_outputs": {"regex": "[0-9"}}, 400,
     "structured_outputs"),   # parsed by the router, compiled (and refused) by the node
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}], "tools": [],
                              "tool_choice": "required"}, 400, "tools"),
    ("/v1/completions", {"model": "demo", "prompt": "x " * 600, "max_tokens": 4}, 400, None),  # too long: the node
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_requests_get_clear_4xx(router, path, body, status, param):
    r = router.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param, err


def test_a_refused_prompt_gets_the_answer_a_node_gives_the_client(cluster, router):
    """The prefill leg asks for one token (max_tokens 1): its 400 for a prompt past the context would name that
    1, not the client's max_tokens. The client gets the decode node's answer to its own request instead."""
    long_chat = [{"role": "user", "content": "x " * 600}]
    for path, body in (("/v1/completions", {"model": "demo", "prompt": "x " * 600, "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": "demo", "messages": long_chat, "max_completion_tokens": 7})):
        want = httpx.post(cluster["d0"].base_url + path[3:], json=body, timeout=60)
        got = router.post(path, body)
        assert got.status_code == want.status_code == 400, got.text
        assert got.json() == want.json(), (got.text, want.text)  # "... (N in the prompt, 4 for the completion)"


def test_malformed_json_is_400(router):
    r = httpx.post(router.url + "/v1/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=1)


COMPLETION = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 2}).encode()
ENCODED_BODIES = [   # (Content-Encoding, body, status): the router and a node give the same answer
    pytest.param("gzip", _gzip(COMPLETION), 200, id="gzip"),   # the router read the gzip bytes as JSON: a 400
    pytest.param("deflate", zlib.compress(COMPLETION), 200, id="deflate"),
    pytest.param("gzip", COMPLETION, 400, id="not-gzip"),        # the node answered 500
    pytest.param("br", COMPLETION, 415, id="br"),   # the node: aiohttp's text/plain 400 "install Brotli"; router 200
    pytest.param("gzip", _gzip(b"{" + b" " * (65 * 1024 * 1024) + b"}"), 413, id="gzip-bomb"),   # 65 MiB decoded
]


@pytest.mark.parametrize("encoding, body, status", ENCODED_BODIES)
def test_a_content_encoded_body_gets_the_nodes_answer(cluster, router, encoding, body, status):
    """A request body with a Content-Encoding: gzip and deflate are read as a node reads them (where the router
    took the compressed bytes for the JSON), any other coding is a 415 at both, and a body that is not what its
    header says is a 400 at both (a node answered 500)."""
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    want = httpx.post(cluster["d0"].url + "/v1/completions", content=body, headers=headers, timeout=60)
    got = httpx.post(router.url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert got.status_code == want.status_code == status, (got.text, want.text)
    if status != 200:
        assert got.json() == want.json(), (got.text, want.text)
        assert set(got.json()["error"]) == {"message", "type", "param", "code"}
    else:
        assert got.json()["usage"]["completion_tokens"] == want.json()["usage"]["completion_tokens"] == 2


def test_several_prompts_and_n_go_decode_only(router):
    before = router.value('pdpool_router_requests_total{decision="decode_only"}')
    r = router.post("/v1/completions", {"model": "demo", "prompt": ["Hello", "The sky is"], "max_tokens": 2,
                                        "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert router.value('pdpool_router_requests_total{decision="decode_only"}') == before + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "n": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}], "n": 2}),
])
def test_beam_search_goes_decode_only_and_is_the_nodes_answer(cluster, router, path, body):
    """A beam search runs a one-token request per beam and step: never handed off, even at width 1; the router's
    answer is a node's."""
    body = {"model": "demo", "max_tokens": 6, "temperature": 0, "use_beam_search": True, **body}
    before = router.value('pdpool_router_requests_total{decision="decode_only"}')
    mine = router.post(path, body)
    assert mine.status_code == 200, mine.text
    assert router.value('pdpool_router_requests_total{decision="decode_only"}') == before + 1
    theirs = httpx.post(cluster["d0"].base_url + path.removeprefix("/v1"), json=body, timeout=60).json()
    key = "text" if "prompt" in body else "message"
    assert [c[key] for c in mine.json()["choices"]] == [c[key] for c in theirs["choices"]]
    assert len(mine.json()["choices"]) == body["n"]


def test_api_key_and_max_inflight(cluster, redis_module, start_router):
    guarded = start_router(redis_flags(redis_module.url) + ["--max-inflight", "1"], name="router-guarded",
                           api_key="s3cret")
    r = httpx.post(guarded.url + "/v1/completions", json=completion_body(PROMPT, 2), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(guarded.url + "/v1/completions", json=completion_body(PROMPT, 2), timeout=30,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(guarded.url + "/v1/completions", json=completion_body(PROMPT, 2), timeout=30,
                   headers={"Authorization": b"Bearer \xff\xfe"})   # no UTF-8: a wrong key, as at a node
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded.url + "/health/ready").status_code == 200  # probes need no key
    assert guarded.post("/v1/completions", completion_body(PROMPT, 2)).status_code == 200

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        codes = list(ex.map(lambda i: guarded.post("/v1/completions", completion_body(PROMPT + str(i), 24,
                                                                                      ignore_eos=True)).status_code,
                            range(4)))
    assert 200 in codes and 429 in codes, codes
    r429 = [c for c in codes if c == 429]
    assert len(r429) >= 1


def test_no_ready_node_is_503(start_router):
    from pdpool.node_process import free_port

    lonely = start_router(["--decode", f"http://127.0.0.1:{free_port()}"], name="router-lonely", wait=False)
    wait_for(lambda: lonely.readiness()[0] != "down", 60, "the router to listen")
    assert httpx.get(lonely.url + "/health/ready").status_code == 503
    r = lonely.post("/v1/completions", completion_body("hi", 2))
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# ---- prefix routing ---------------------------------------------------------------------------------------

GROUPS, PER_GROUP = 8, 10
WORDS = ("river mountain lantern harbor violet copper meadow falcon orchard glacier pepper saddle thunder "
         "marble cinder willow beacon quartz timber canyon").split()


def workload(tag: str):
    import random

    rng = random.Random(tag)
    systems = [f"[{tag} group {g}] " + " ".join(rng.choice(WORDS) for _ in range(70)) for g in range(GROUPS)]
    return [[f"{systems[g]}\nQuestion {i}: {' '.join(rng.choice(WORDS) for _ in range(8))}?"
             for i in range(PER_GROUP)] for g in range(GROUPS)]


def achievable_hit_tokens(groups) -> tuple[int, int]:
    """(hit tokens if each group always met its own earlier prompts, shortest shared prefix in blocks)."""
    from pdpool.frontend import Frontend

    fe = Frontend.from_model("demo")
    total, shortest = 0, 10**9
    for prompts in groups:
        ids = [fe.encode_prompt(p, True) for p in prompts]
        for i in range(1, len(ids)):
            common = max(_common(ids[i], ids[j]) for j in range(i))
            total += min(common, len(ids[i]) - 1) // 16 * 16
            shortest = min(shortest, common // 16)
    return total, shortest


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hit_tokens(cluster) -> float:
    return sum(cluster[n].value("pdpool_prefix_cache_hit_tokens_total") for n in ("d0", "d1"))


def run_workload(routers, groups) -> float:
    """Waves: request i of every group, all 8 at once; returns the realized hit tokens on the decode nodes."""
    import concurrent.futures

    before = hit_tokens(cluster_ref[0])
    k = 0
    with concurrent.futures.ThreadPoolExecutor(GROUPS) as ex:
        for i in range(PER_GROUP):
            jobs = []
            for g in range(GROUPS):
                r = routers[k % len(routers)]
                k += 1
                jobs.append(ex.submit(r.post, "/v1/completions", {"model": "demo", "prompt": groups[g][i],
                                                                  "max_tokens": 1, "temperature": 0}))
            for j in jobs:
                assert j.result().status_code == 200, j.result().text
            time.sleep(0.25)  # the nodes' block events reach Redis
    time.sleep(0.5)
    return hit_tokens(cluster_ref[0]) - before


cluster_ref: list = []
DECODE_ONLY = ["--disagg-min-tokens", "100000"]  # the decode nodes' own prefix caches are what is measured


def test_prefix_routing_reaches_the_achievable_hit_ratio(cluster, redis_module, start_router):
    cluster_ref[:] = [cluster]
    default = start_router(redis_flags(redis_module.url) + DECODE_ONLY, name="router-prefix")
    groups = workload("default")
    achievable, shortest = achievable_hit_tokens(groups)
    assert shortest >= 4, "each group must share at least 4 blocks"
    realized = run_workload([default], groups)
    assert realized >= 0.9 * achievable, (realized, achievable)
    m = default.metrics()
    assert m['pdpool_router_prefix_realized_hit_tokens_total{role="decode"}'] >= 0.9 * achievable


def test_round_robin_is_clearly_worse(cluster, redis_module, start_router):
    """Round-robin spreads every group over both decode nodes, so each node needs every group's prefix: 7 groups x
    ~7 blocks do not fit in a node's 40 blocks, and a cyclic order makes LRU evict each prefix just before its
    group comes back. (Prefix-aware routing keeps ~3-4 groups per node, which fit.) The requests go one at a
    time, in group order, so the outcome does not depend on which of 8 concurrent requests arrives first: with an
    odd number of groups, strict alternation sends each group to the other node every round."""
    cluster_ref[:] = [cluster]
    rr = start_router(redis_flags(redis_module.url) + DECODE_ONLY + ["--picker", "round-robin"], name="router-rr")
    groups = workload("round-robin")[:7]
    achievable, _ = achievable_hit_tokens(groups)
    before = hit_tokens(cluster)
    for i in range(PER_GROUP):
        for prompts in groups:
            r = rr.post("/v1/completions", {"model": "demo", "prompt": prompts[i], "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
        time.sleep(0.25)  # the nodes' block events reach Redis
    realized = hit_tokens(cluster) - before
    assert realized < 0.5 * achievable, (realized, achievable)


def test_two_routers_share_the_precise_index(cluster, redis_module, start_router):
    cluster_ref[:] = [cluster]
    a = start_router(redis_flags(redis_module.url) + DECODE_ONLY, name="router-aa-1")
    b = start_router(redis_flags(redis_module.url) + DECODE_ONLY, name="router-aa-2")
    groups = workload("active-active")
    achievable, _ = achievable_hit_tokens(groups)
    realized = run_workload([a, b], groups)  # consecutive requests alternate between the routers
    assert realized >= 0.9 * achievable, (realized, achievable)


# ---- the node-side fuzz test, against the router ----------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("PDPOOL_ROUTER_FUZZ_EXAMPLES", "25"))


def test_fuzzed_requests_never_break_the_router(cluster, router):
    """``tests/server/fuzz_strategies.py`` (the node's fuzzing) against the router: no 5xx, OpenAI errors, valid
    batch-mates succeed, and afterwards every node has all its blocks back and no lease."""
    import asyncio

    from hypothesis import HealthCheck, given, settings, strategies as st

    from fuzz_strategies import check_answer, fuzz_cases, send, valid_completion

    start = free_blocks(cluster)
    valid = valid_completion("demo", None, 2)
    seen = {"cases": 0, "status": set()}

    async def exchange(cases) -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
            batch = [valid, *cases, valid]
            answers = await asyncio.gather(*[send(client, case) for case in batch])
        for case, answer in zip(batch, answers):
            check_answer(case, answer)
            if answer is not None:
                seen["status"].add(answer.status)
            if case is valid:
                assert answer.status == 200, answer.body[:500]
        seen["cases"] += len(cases)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.lists(fuzz_cases("demo", None), min_size=3, max_size=5))
    def fuzz(cases):
        asyncio.run(exchange(cases))

    fuzz()
    assert {200, 400} <= seen["status"], seen
    assert httpx.get(router.url + "/health/ready").status_code == 200
    wait_no_leaks(cluster, start, 60)


# ---- failure handling ----------------------------------------------------------------------------------------

def test_prefill_refusal_falls_back_to_decode_only(cluster, router):
    long_prompt = " ".join(WORDS[i % len(WORDS)] + str(i) for i in range(130))  # ~440 tokens > 24 blocks (the cap)
    body = completion_body(long_prompt, 4)
    want = token_ids(cluster["p0"].complete(body))
    before = router.value('pdpool_router_requests_total{decision="fallback"}')
    r = router.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert token_ids(r.json()) == want
    assert router.value('pdpool_router_requests_total{decision="fallback"}') == before + 1
    assert router.value('pdpool_router_upstream_errors_total{kind="http_429",node="p0"}') >= 1
    time.sleep(0.6)  # the prefill node's cooldown ends


def test_client_disconnect_mid_stream_frees_both_nodes(cluster, router):
    start = free_blocks(cluster)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                      json=completion_body(PROMPT + " Again,", 200, ignore_eos=True, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first event, then the client goes away
    wait_no_leaks(cluster, start, 15)


def test_client_disconnect_during_prefill_releases_the_lease_at_once(cluster, router):
    start = free_blocks(cluster)
    expiries = cluster["p0"].value("pdpool_kv_lease_expiries_total")
    prompt = " ".join(WORDS[(7 * i) % len(WORDS)] + str(i) for i in range(110))  # ~20 blocks: a slow prefill
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json=completion_body(prompt, 50, ignore_eos=True), timeout=0.3)
    wait_no_leaks(cluster, start, 15)  # well before the 30 s lease would expire
    assert cluster["p0"].value("pdpool_kv_lease_expiries_total") == expiries


def test_redis_down_routing_continues_then_precise_again(cluster, redis_module, router):
    redis_module.stop()
    try:
        for i in range(3):
            r = router.post("/v1/completions", completion_body(PROMPT + f" Redis is down {i}.", 3))
            assert r.status_code == 200, r.text
        assert router.value('pdpool_router_index_mode{mode="approximate"}') == 1
        assert router.value("pdpool_router_index_degradations_total") >= 1
    finally:
        redis_module.start()

    def precise():   # no request needed: the index mirror reading Redis whole again says so
        return router.value('pdpool_router_index_mode{mode="precise"}') == 1

    wait_for(precise, 20, "the router to go back to the precise index")
    r = router.post("/v1/completions", completion_body(PROMPT, 2))
    assert r.status_code == 200 and precise()


def test_decode_failures_retry_or_end_the_stream(cluster, start_router):
    """One node dies: the stream it was serving gets a final error event; requests routed to it afterwards,
    before the router notices, are retried on the other decode node; the prefill lease is not leaked."""
    static = start_router(["--prefill", cluster["p0"].url, "--decode", cluster["d0"].url, "--decode",
                           cluster["d1"].url, "--picker", "round-robin", "--discovery-seconds", "30",
                           "--node-cooldown", "0"], name="router-static")
    assert static.post("/v1/completions", completion_body(PROMPT, 2)).status_code == 200  # static nodes work
    with httpx.stream("POST", static.url + "/v1/completions", timeout=60,
                      json=completion_body(PROMPT + " Story:", 400, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        victim = wait_for(lambda: next((n for n in ("d0", "d1")
                                        if cluster[n].value("pdpool_num_requests_running") > 0), None), 10,
                          "the decode node serving the stream")
        cluster[victim].kill()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest and "error" in json.loads(rest[-1][6:]), rest[-3:]
    error = json.loads(rest[-1][6:])["error"]  # a server-side failure, not the client's ("invalid_request_error")
    assert (error["code"], error["type"]) == ("upstream_stream_broken", "internal_server_error"), error
    start_p0 = cluster["p0"].kv()["free"]
    codes = [static.post("/v1/completions", completion_body(PROMPT + f" retry {i}", 3)).status_code
             for i in range(4)]
    assert codes == [200] * 4
    assert static.value('pdpool_router_requests_total{decision="retry"}') >= 1
    wait_for(lambda: cluster["p0"].kv()["leases"] == 0 and cluster["p0"].kv()["free"] == start_p0, 15,
             "the prefill node's leases to be released")


def test_prefill_node_dies_requests_go_decode_only(cluster, start_router):
    survivor = next(n for n in ("d0", "d1") if cluster[n].alive)
    router = start_router(["--prefill", cluster["p0"].url, "--decode", cluster[survivor].url,
                           "--discovery-seconds", "30"], name="router-static-2")
    cluster["p0"].kill()
    before = router.value('pdpool_router_requests_total{decision="fallback"}')
    r = router.post("/v1/completions", completion_body(PROMPT, 3))
    assert r.status_code == 200, r.text
    assert router.value('pdpool_router_requests_total{decision="fallback"}') == before + 1
    assert router.value('pdpool_router_upstream_errors_total{kind="connect",node="%s"}' % cluster["p0"].url) == 1
