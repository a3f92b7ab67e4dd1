"""``POST /v1/responses`` through the router (1 prefill + 2 decode nodes, real Redis and NIXL): routed as its chat
request (the prefill leg is that chat request, the decode node answers with a Response), the same greedy answer a
colocated node gives, whole and streamed with the openai client; refusals before any routing; no KV block kept."""

from __future__ import annotations

import httpx
import pytest

from routers import redis_flags
from test_router_e2e import PROMPT, free_blocks, wait_no_leaks

pytestmark = pytest.mark.timeout(600)

QUESTION = PROMPT + " Where is the village?"
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 16}}}


@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    return start_router(redis_flags(redis_module.url), name="router-responses")


def handed_off(router) -> float:
    return router.value('pdpool_router_requests_total{decision="disaggregated"}')


def test_a_handed_off_response_equals_a_colocated_nodes(cluster, router):
    import openai

    start = free_blocks(cluster)
    colocated = openai.OpenAI(base_url=cluster["d0"].base_url, api_key="unused", max_retries=0, timeout=120)
    client = router.client()
    want = colocated.responses.create(model="demo", input=QUESTION, instructions="Answer briefly.",
                                      max_output_tokens=16, temperature=0)
    before = handed_off(router)
    got = client.responses.create(model="demo", input=QUESTION, instructions="Answer briefly.",
                                  max_output_tokens=16, temperature=0)
    assert handed_off(router) == before + 1
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.output_text == want.output_text and got.status == want.status
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.input_tokens, want.usage.output_tokens)
    chat = client.chat.completions.create(model="demo", max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == got.output_text

    events = list(client.responses.create(model="demo", input=QUESTION, instructions="Answer briefly.",
                                          max_output_tokens=16, temperature=0, stream=True))
    assert handed_off(router) == before + 3
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens
    wait_no_leaks(cluster, start)


def test_a_function_call_across_the_handoff(cluster, router):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    body = {"model": "demo", "input": QUESTION + " What is the weather there?", "max_output_tokens": 60,
            "temperature": 0, "tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}}
    before = handed_off(router)
    mine = router.post("/v1/responses", body)
    assert mine.status_code == 200, mine.text
    assert handed_off(router) == before + 1
    theirs = httpx.post(cluster["d0"].base_url + "/responses", json=body, timeout=60).json()
    call = mine.json()["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["arguments"] == theirs["output"][0]["arguments"]


def test_refused_before_routing_naming_the_field(router):
    before = handed_off(router)
    for body, param in (({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools"),
                        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
                        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "x", "pdpool_prompt_token_ids": [[1]]}, "pdpool_prompt_token_ids")):
        r = router.post("/v1/responses", {"model": "demo", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert handed_off(router) == before


def test_the_relay_ends_a_responses_stream_at_its_last_event():
    """Unit: a Responses stream has no [DONE]; the relay passes its events unchanged, ends at response.completed
    (or an error event) and reads the realized prefix hits from the completed response's usage."""
    from pdpool.router.sse import SSERelay

    created = b'event: response.created\ndata: {"type": "response.created", "response": {"usage": null}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "hi"}\n\n'
    done = (b'event: response.completed\ndata: {"type": "response.completed", "response": {"usage": '
            b'{"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}}}}\n\n')
    relay = SSERelay(hide_usage=False)
    sent = relay.feed(created + delta[:20]) + relay.feed(delta[20:]) + relay.feed(done)
    assert sent == created + delta + done and relay.done
    assert relay.usage["input_tokens_details"]["cached_tokens"] == 32
    failed = SSERelay(hide_usage=False)
    failed.feed(created + b'event: error\ndata: {"type": "error", "code": "500", "message": "x"}\n\n')
    assert failed.done
