"""A request's ``chat_template``, chat ``echo`` and ``return_tokens_as_token_ids`` through the router: the router
renders the request's template to tokenize and hash the prompt, as the nodes render it (both started with
--trust-request-chat-template), and a handed-off answer is a colocated node's, whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest

from cluster import running_nodes
from routers import redis_flags

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "You answer in one line. " * 6},
            {"role": "user", "content": "Name the largest planet of the solar system."},
            {"role": "assistant", "content": "The largest planet is"}]
TRUST = ["--trust-request-chat-template"]
DISAGGREGATED = 'pdpool_router_requests_total{decision="disaggregated"}'


@pytest.fixture(scope="module")
def trusting(demo_model_dir, tmp_path_factory, redis_module):
    spec = {"tp0": ("prefill", TRUST), "td0": ("decode", TRUST)}
    with running_nodes(spec, tmp_path_factory.mktemp("trusting"), redis_module.url) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def router(trusting, redis_module, start_router):
    return start_router(redis_flags(redis_module.url) + TRUST, name="router-trusting")


def stream_events(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def content(chunks: list[dict]) -> tuple[str, list]:
    text, tokens = "", []
    for c in chunks:
        for choice in c["choices"]:
            text += choice["delta"].get("content") or ""
            tokens += [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
    return text, tokens


def test_a_request_template_echo_and_token_names_hold_across_the_handoff(trusting, router):
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "chat_template": TEMPLATE,
            "add_generation_prompt": False, "continue_final_message": True, "echo": True, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
    before = router.value(DISAGGREGATED)
    mine = router.post("/v1/chat/completions", body)
    assert mine.status_code == 200, mine.text
    assert router.value(DISAGGREGATED) == before + 1
    theirs = httpx.post(trusting["td0"].base_url + "/chat/completions", json=body, timeout=120).json()
    mine = mine.json()
    rendered = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in MESSAGES[:-1]) + \
        f"<assistant>{MESSAGES[-1]['content']}"
    assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert httpx.post(trusting["td0"].url + "/detokenize", json={"tokens": mine["prompt_token_ids"]},
                      timeout=30).json()["prompt"] == rendered   # the request's template, not the model's
    got, want = mine["choices"][0], theirs["choices"][0]
    assert got["message"] == want["message"] and got["message"]["content"].startswith(MESSAGES[-1]["content"])
    assert [e["token"] for e in got["logprobs"]["content"]] == [f"token_id:{t}" for t in got["token_ids"]]
    assert got["token_ids"] == want["token_ids"]
    streamed = stream_events(router.url + "/v1/chat/completions", body)
    assert content(streamed) == (got["message"]["content"], [e["token"] for e in got["logprobs"]["content"]])


def test_the_router_renders_the_template_for_tokenize_and_refuses_a_bad_one(router):
    body = {"model": "demo", "messages": MESSAGES[:2], "chat_template": TEMPLATE}
    tokens = router.post("/tokenize", body).json()["tokens"]
    assert router.post("/tokenize", {**body, "chat_template": None}).json()["tokens"] != tokens
    r = router.post("/v1/chat/completions", {**body, "chat_template": "{% for m in messages %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_a_router_without_the_flag_refuses_a_request_template(trusting, redis_module, start_router):
    untrusting = start_router(redis_flags(redis_module.url), name="router-untrusting")
    r = untrusting.post("/v1/chat/completions", {"model": "demo", "messages": MESSAGES[:2], "chat_template": TEMPLATE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_chat_template_kwargs_render_alike_across_the_handoff(trusting, router):
    """The router renders a request's chat_template_kwargs as the nodes do, so it hashes the prompt they run."""
    template = "{% if enable_thinking %}<think>{% endif %}" + TEMPLATE
    body = {"model": "demo", "messages": MESSAGES[:2], "max_tokens": 4, "temperature": 0, "chat_template": template,
            "chat_template_kwargs": {"enable_thinking": True}, "return_token_ids": True}
    tokens = router.post("/tokenize", body).json()["tokens"]
    assert tokens != router.post("/tokenize", {**body, "chat_template_kwargs": None}).json()["tokens"]
    before = router.value(DISAGGREGATED)
    mine = router.post("/v1/chat/completions", body)
    assert mine.status_code == 200, mine.text
    assert router.value(DISAGGREGATED) == before + 1
    theirs = httpx.post(trusting["td0"].base_url + "/chat/completions", json=body, timeout=120).json()
    assert mine.json()["prompt_token_ids"] == theirs["prompt_token_ids"] == tokens
    assert mine.json()["choices"][0]["message"] == theirs["choices"][0]["message"]
