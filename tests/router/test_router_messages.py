"""``POST /v1/messages`` (Anthropic's Messages API) through the router (1 prefill + 2 decode nodes, real Redis and
NIXL): routed as its chat request (the prefill leg is that chat request, the decode node answers with a Message),
the same greedy answer a colocated node gives, whole and streamed with the anthropic client; count_tokens from the
router's own front end; refusals and auth in Anthropic's shape before any routing; no KV block or lease kept."""

from __future__ import annotations

import httpx
import pytest

from routers import redis_flags
from test_router_e2e import PROMPT, free_blocks, wait_no_leaks
from test_router_responses import WEATHER

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(600)

QUESTION = PROMPT + " Where is the village?"
GREEDY = {"temperature": 0}   # the SDK's create() takes no sampling fields: in the body
KEY = "router-messages-key"


@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    return start_router(redis_flags(redis_module.url), name="router-messages", api_key=KEY)


def handed_off(router) -> float:
    return router.value('pdpool_router_requests_total{decision="disaggregated"}')


def claude(url: str, **kw):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120, **kw)


def test_a_handed_off_message_equals_a_colocated_nodes(cluster, router):
    start = free_blocks(cluster)
    kwargs = dict(model="demo", system="Answer briefly.", max_tokens=16, extra_body=GREEDY,
                  messages=[{"role": "user", "content": QUESTION}])
    want = claude(cluster["d0"].url).messages.create(**kwargs)
    client = claude(router.url)
    before = handed_off(router)
    got = client.messages.create(**kwargs)
    assert handed_off(router) == before + 1
    assert got.id.startswith("msg_") and got.type == "message"
    assert got.content[0].text == want.content[0].text and got.stop_reason == want.stop_reason
    assert got.usage.output_tokens == want.usage.output_tokens
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == \
        want.usage.input_tokens + want.usage.cache_read_input_tokens
    chat = router.client().chat.completions.create(model="demo", max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == got.content[0].text

    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert handed_off(router) == before + 3
    assert text == final.content[0].text == want.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (want.stop_reason, want.usage.output_tokens)
    r = router.post("/v1/messages", {**GREEDY, **{k: v for k, v in kwargs.items() if k != "extra_body"},
                                     "stream": True}, headers={"x-api-key": KEY})
    kinds = [line[7:] for line in r.text.split("\n") if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    wait_no_leaks(cluster, start)


def test_a_tool_use_across_the_handoff(cluster, router):
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    body = {"model": "demo", "max_tokens": 60, **GREEDY, "tools": tools,
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": QUESTION + " What is the weather there?"}]}
    before = handed_off(router)
    mine = router.post("/v1/messages", body)
    assert mine.status_code == 200, mine.text
    assert handed_off(router) == before + 1
    theirs = httpx.post(cluster["d0"].url + "/v1/messages", json=body, timeout=60).json()
    assert [{**b, "id": None} for b in mine.json()["content"]] == [{**b, "id": None} for b in theirs["content"]]
    assert mine.json()["content"][0]["type"] == "tool_use" and mine.json()["stop_reason"] == "tool_use"


def test_count_tokens_refusals_and_auth_before_routing(cluster, router):
    messages = [{"role": "user", "content": QUESTION}]
    want = claude(cluster["d0"].url).messages.count_tokens(model="demo", system="Be brief.", messages=messages)
    assert claude(router.url).messages.count_tokens(model="demo", system="Be brief.", messages=messages) == want
    before = handed_off(router)
    for body in ({"messages": messages},
                 {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                 {"max_tokens": 4, "messages": messages, "pdpool_prompt_token_ids": [[1]]}):
        r = router.post("/v1/messages", {"model": "demo", **body})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = router.post("/v1/messages", {"model": "demo", "max_tokens": 4, "messages": messages},
                    headers={"x-api-key": "wrong", "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    assert handed_off(router) == before


def test_the_relay_ends_a_messages_stream_at_message_stop():
    """Unit: a Messages stream has no [DONE]; the relay passes its events unchanged, ends at message_stop (or an
    error event) and reads the realized prefix hits from message_delta's usage."""
    from pdpool.router.handoff import _cached_tokens
    from pdpool.router.sse import SSERelay

    start = b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {"input_tokens": 9}}}\n\n'
    delta = (b'event: message_delta\ndata: {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, '
             b'"usage": {"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 32}}\n\n')
    stop = b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
    relay = SSERelay(hide_usage=False)
    sent = relay.feed(start + delta[:20]) + relay.feed(delta[20:])
    assert not relay.done
    sent += relay.feed(stop)
    assert sent == start + delta + stop and relay.done
    assert _cached_tokens({"usage": relay.usage}) == 32
    failed = SSERelay(hide_usage=False)
    failed.feed(start + b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n')
    assert failed.done
