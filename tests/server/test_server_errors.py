"""Every failure is OpenAI error JSON with the right status; the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdpool.server.errors import APIError, error_middleware
from pdpool.server import json_body
from pdpool.server.json_body import MAX_JSON_DEPTH, read_json_body


def post(server, path, body=None, *, content=None, headers=None):
    h = {**server.headers(), **(headers or {})}
    return httpx.post(server.url + path, json=body, content=content, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_malformed_json_is_400(server):
    assert_error(post(server, "/v1/completions", content=b'{"model": "demo", "prompt": '), 400)
    assert_error(post(server, "/v1/chat/completions", content=b"[1, 2]"), 400)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)
    assert info.value.body["param"] == "model"


def test_prompt_filling_the_context_is_400_with_the_numbers(server, client):
    """A prompt that leaves no room for one token; max_tokens beyond what it leaves is capped instead (vLLM 0.32:
    tests/server/test_server_max_tokens.py)."""
    max_model_len = server.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=[1] * max_model_len, max_tokens=4)
    message = str(info.value)
    assert "maximum context length" in message and str(max_model_len) in message
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi " * 600}])
    assert str(max_model_len) in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 1.5), ("logprobs", 50), ("n", 0), ("max_tokens", 0), ("top_k", -5),
    ("presence_penalty", 3), ("repetition_penalty", 0), ("min_p", 2), ("stop", [""]), ("seed", "x"),
    ("priority", 1.5), ("stop_token_ids", ["a"]), ("min_tokens", 99),
])
def test_out_of_range_params_are_400_naming_the_param(server, field, value):
    body = {"model": "demo", "prompt": "hi", "max_tokens": 4, field: value}
    assert_error(post(server, "/v1/completions", body), 400, param=field)


def test_bad_prompts_and_messages_are_400(server):
    assert_error(post(server, "/v1/completions", {"model": "demo"}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": "demo", "prompt": [[1, 2], "x"]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"model": "demo", "prompt": [10 ** 9]}), 400, "prompt")
    assert_error(post(server, "/v1/chat/completions", {"model": "demo", "messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"model": "demo", "messages": [{"content": "x"}]}), 400)
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_error(post(server, "/v1/chat/completions", body), 400, "top_logprobs")


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),   # no schema
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    # tools with tool_choice "auto" (their default): the model's own call format, which needs a parser per model
    # (tests/server/test_server_tool_calls.py has "required" and named functions, which are served)
    ("/v1/chat/completions", {"tools": [TOOL]}, "tool_choice"),
    ("/v1/completions", {"tools": [TOOL], "tool_choice": "required"}, "tools"),   # completions take no tools
    ("/v1/chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    # a forced call without tools (or with an empty list) was answered in plain text (found by a black-box pass)
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),   # vLLM 0.32: tool_choice needs tools
    ("/v1/chat/completions", {"tools": [], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     "tools"),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none"}, "tools"),   # vLLM 0.32: an empty list is a 400
    ("/v1/chat/completions", {"function_call": {"name": "lookup"}}, "function_call"),
    # vLLM's fields pdpool does not implement were ignored: another answer than the one asked for
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),   # null or at least one id
    ("/v1/completions", {"bad_words": [5]}, "bad_words"),   # strings only
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),   # vLLM: the whole vocabulary; here at most 20
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),   # -1 or >= 1
    ("/v1/completions", {"use_beam_search": True, "stop": ["."]}, "stop"),   # vLLM's beam search drops stop
    ("/v1/completions", {"logits_processors": ["x"]}, "logits_processors"),
    ("/v1/chat/completions", {"chat_template": "{{ 'x' }}"}, "chat_template"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
])
def test_what_would_be_silently_dropped_is_400(server, path, extra, param):
    """Tool calls the server cannot make ("auto", completions, the legacy functions), and malformed options
    would be dropped: refused by name, not answered in plain text."""
    body = {"model": "demo", "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    assert_error(post(server, path, body), 400, param=param)


def test_plain_text_format_and_tools_declined_by_tool_choice_are_served(server):
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({"response_format": {"type": "text"}}, {"tools": [TOOL], "tool_choice": "none"},
                  {"tool_choice": "none"},
                  {"use_beam_search": False, "bad_words": [], "echo": False, "prompt_logprobs": None},
                  {"echo": True},
                  {"some_field_vllm_does_not_know": 1}):
        r = post(server, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text


def test_a_model_is_retrieved_by_name(server, client):
    assert client.models.retrieve("demo").id == "demo"
    r = httpx.get(server.url + "/v1/models/other/name", headers=server.headers(), timeout=30)
    assert_error(r, 404, param="model")


def test_api_key_is_required_on_v1_only(server):
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert_error(r, 401)
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert_error(r, 401)
    assert_error(httpx.get(server.url + "/v1/models", timeout=30), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_a_key_that_is_not_utf8_is_401_not_500(server):
    """Header bytes that are no UTF-8 (aiohttp keeps them as lone surrogates) are a wrong key, in each API's
    shape, where comparing them with the key raised UnicodeEncodeError: a 500."""
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": b"Bearer \xff\xfe"},
                   timeout=30)
    assert_error(r, 401)
    messages = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/messages", json=messages, headers={"x-api-key": b"k\xe9y"}, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"


MALFORMED_HTTP = [   # what aiohttp's parser refuses before any handler runs
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBad Header Line\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


def raw_exchange(server, raw: bytes) -> tuple[int, dict, bytes]:
    """``raw`` sent on a new connection, read to its close: the answer's status, headers (lower-case names), body."""
    import socket

    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict((name.strip().lower(), value.strip()) for name, _, value in (line.partition(":") for line in lines))
    return int(status_line.split(" ")[1]), headers, body


def test_malformed_http_is_400_and_one_log_line_without_a_traceback(server):
    """A request the HTTP parser refuses gets its 400 as OpenAI error JSON, as the router answers it (aiohttp
    answered plain text), the node logs one info line per request naming the client, never aiohttp's error with a
    traceback (a client could fill the log with them), and goes on serving."""
    start = server.log_path.stat().st_size
    for raw in MALFORMED_HTTP:
        status, headers, body = raw_exchange(server, raw)
        assert status == 400, body[:200]
        assert headers["content-type"].startswith("application/json"), (headers, body[:200])
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["code"] == 400, err
        assert err["message"].startswith("malformed HTTP request: ") and "\n" not in err["message"], err
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    log = server.log_path.read_bytes()[start:].decode(errors="replace")
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
    assert log.count("malformed HTTP request from 127.0.0.1") == len(MALFORMED_HTTP), log[-3000:]


def test_a_body_declared_past_the_limit_is_413_at_once(server):
    """A Content-Length over the 64 MiB limit is a 413 before any of the body arrives, as the router answers it,
    where the node waited for the body (a client that sends only the head never got an answer)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.api_key.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 999999999999\r\nConnection: close\r\n\r\n")
    import socket

    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert err == {"message": "the request body is larger than 67108864 bytes", "type": "invalid_request_error",
                   "param": None, "code": 413}


def test_a_body_that_is_not_its_content_encoding_is_400(server):
    """A body whose Content-Encoding (gzip, deflate) it does not hold is the client's error, where aiohttp's
    decompression error was a 500; a coding the node does not read is a 415, where aiohttp's parser answered
    text/plain 400 ("install Brotli") or took the bytes as they were."""
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 1}).encode()
    for encoding in ("gzip", "deflate", "x-gzip"):
        err = assert_error(post(server, "/v1/completions", content=body, headers={"Content-Encoding": encoding}), 400)
        assert f"not valid {encoding} data" in err["message"], err
    for encoding in ("br", "zstd", "compress"):
        assert_error(post(server, "/v1/completions", content=body, headers={"Content-Encoding": encoding}), 415)
    import gzip

    r = post(server, "/v1/completions", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = post(server, "/v1/completions", content=gzip.compress(body)[:-12], headers={"Content-Encoding": "gzip"})
    assert "ends before its end marker" in assert_error(r, 400)["message"]


def test_a_header_past_the_routers_limit_is_431_and_one_within_it_is_served(server):
    """The node's line limit is the router's head limit (64 KiB), and past it the answer is the router's 431, where
    aiohttp refused a header line over 8190 bytes with a 400 (a long token or cookie the router takes)."""
    start = server.log_path.stat().st_size
    status, _, body = raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Long: " +
                                   b"a" * 20000 + b"\r\n\r\n")
    assert status == 200, body[:200]
    for raw in (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n",
                b"GET /health?" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"):
        status, _, body = raw_exchange(server, raw)
        assert status == 431, body[:200]
        assert json.loads(body)["error"] == {"message": "the request line or a header is longer than 65536 bytes",
                                             "type": "invalid_request_error", "param": None, "code": 431}
    log = server.log_path.read_bytes()[start:].decode(errors="replace")
    assert log.count("(answered 431)") == 2 and "Traceback" not in log, log[-2000:]


def test_an_expectation_the_node_cannot_meet_is_417_json(server):
    """``Expect`` other than ``100-continue`` is a 417 in the OpenAI shape (aiohttp answered text/plain, its check
    runs before the app's middlewares); ``100-continue`` gets its interim answer, then the request's."""
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.api_key.encode() +
            b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n" % len(body))
    status, headers, answer = raw_exchange(server, head + b"Expect: teapot\r\n\r\n" + body)
    assert status == 417 and headers["content-type"].startswith("application/json"), (headers, answer)
    assert json.loads(answer)["error"] == {"message": "Unknown Expect: teapot", "type": "invalid_request_error",
                                           "param": None, "code": 417}
    status, _, answer = raw_exchange(server, head + b"Expect: 100-continue\r\n\r\n" + body)
    assert status == 100 and b"HTTP/1.1 200 OK" in answer, answer[:300]


def test_unknown_route_and_method_are_json(server):
    assert_error(httpx.get(server.url + "/v1/nope", headers=server.headers(), timeout=30), 404)
    assert_error(httpx.get(server.url + "/v1/completions", headers=server.headers(), timeout=30), 405)


def test_server_keeps_serving_after_errors(server, client):
    for _ in range(3):
        post(server, "/v1/completions", content=b"{")
    assert client.completions.create(model="demo", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert models.data[0].model_extra["max_model_len"] == server.max_model_len
    for path in ("/health", "/health/live", "/health/ready"):
        assert httpx.get(server.url + path, timeout=30).status_code == 200
    import pdpool

    version = httpx.get(server.url + "/version", timeout=30)   # vLLM's route; public, as vLLM's
    assert version.status_code == 200 and version.json() == {"version": pdpool.__version__}


def test_unexpected_exception_is_500_json_and_the_app_stays_up():
    asyncio.run(_unexpected_exception())


async def _unexpected_exception():
    # The middleware every node app uses, on a route that fails the way a bug would.
    async def broken(request):
        raise RuntimeError("boom")

    async def fine(request):
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/broken", broken)
    app.router.add_get("/fine", fine)
    async with TestClient(TestServer(app)) as c:
        r = await c.get("/broken")
        assert r.status == 500
        err = (await r.json())["error"]
        assert err["type"] == "internal_server_error"
        assert "boom" not in err["message"] and "RuntimeError" not in err["message"]  # nothing internal leaks
        error_id = re.search(r"error id ([0-9a-f]+)", err["message"]).group(1)
        assert (await c.get("/fine")).status == 200
    return error_id


async def _stalled_body_answer() -> tuple[bytes, float]:
    async def echo(request):
        return web.json_response(await json_body.read_json(request))

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/echo", echo)
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{\"a\":")   # then stalls
        start = time.monotonic()
        answer = await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        return answer, time.monotonic() - start


def test_a_body_that_stops_arriving_is_408(monkeypatch):
    """A client that sends the head and part of the body, then nothing, gets a 408 after ``REQUEST_SECONDS``, as
    the router answers it, where the node's handler waited for the rest for ever."""
    monkeypatch.setattr(json_body, "REQUEST_SECONDS", 0.5, raising=False)   # (absent before the limit)
    answer, waited = asyncio.run(_stalled_body_answer())
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"] == \
        "the request was not received within 0.5 s"
    assert 0.4 < waited < 10


async def _seconds_until_closed(first_bytes: bytes) -> tuple[float, bytes]:
    from pdpool.config import NodeConfig
    from pdpool.server.app import create_app
    from pdpool.server.errors import NodeRunner

    runner = NodeRunner(create_app(NodeConfig(), node=None), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first_bytes)
        start = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 10)   # to the close
        writer.close()
        return time.monotonic() - start, rest
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("first_bytes", [b"", b"GET /health HTTP/1.1\r\nHo"], ids=["idle", "head-stopped"])
def test_an_idle_or_stalled_connection_is_closed_after_request_seconds(monkeypatch, first_bytes):
    """A node closes a connection that sends nothing, or stops inside a request head, after ``REQUEST_SECONDS``
    (75 s), as the router does, where aiohttp's default held it for 3630 s."""
    monkeypatch.setattr(json_body, "REQUEST_SECONDS", 0.5)
    waited, rest = asyncio.run(_seconds_until_closed(first_bytes))
    assert rest == b"" and waited < 5, (waited, rest)


def test_a_500_names_an_error_id_that_the_log_has_with_the_traceback(caplog):
    with caplog.at_level(logging.ERROR, logger="pdpool.server"):
        error_id = asyncio.run(_unexpected_exception())
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "boom" in logged[0].exc_text


# ---- the JSON reader: every malformed body is a 400 ---------------------------------------------

def nested(depth: int, leaf: str = "1") -> bytes:
    return ('{"a": ' + "[" * (depth - 1) + leaf + "]" * (depth - 1) + "}").encode()


@pytest.mark.parametrize("raw, says", [
    (b"", "empty"),
    (b"\xff\xfe{}", "UTF-8"),
    ('{"prompt": "caf\u00e9"}'.encode("latin-1"), "UTF-8"),
    (b'{"temperature": NaN}', "NaN is not JSON"),
    (b'{"temperature": Infinity}', "Infinity is not JSON"),
    (b'{"temperature": -Infinity}', "-Infinity is not JSON"),
    (b'{"temperature": 1e400}', "out of range"),
    (b'{"temperature": -1e400}', "out of range"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "malformed JSON"),  # beyond Python's int digit limit
    (b"\xef\xbb\xbf{}", "malformed JSON"),  # a UTF-8 BOM
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b'{"a": 1', "malformed JSON"),
    (nested(MAX_JSON_DEPTH + 1), "nested"),
    (nested(5000), "nested"),
    (nested(200_000), "nested"),
    (b'{"a": ' + b'{"b": ' * 3000 + b"1" + b"}" * 3000 + b"}", "nested"),
])
def test_read_json_body_refuses_with_a_400(raw, says):
    with pytest.raises(APIError) as info:
        read_json_body(raw)
    assert info.value.status == 400 and says in info.value.message, info.value.message
    assert len(info.value.message) < 400


def test_read_json_body_takes_what_an_openai_body_needs():
    assert read_json_body(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    big = {"prompt": list(range(200_000)), "stop": ["\u00e9", "\U0001f600"], "temperature": 1e300, "seed": -1}
    assert read_json_body(json.dumps(big).encode()) == big
    assert read_json_body(json.dumps(big, ensure_ascii=False).encode()) == big


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content, content_type", [
    (nested(5000), "application/json"),
    (b'{"model": "demo", "prompt": "hi", "temperature": NaN}', "application/json"),
    (b'{"model": "demo", "prompt": "hi", "max_tokens": 1e400}', "application/json"),
    (b"\xc3\x28", "application/json"),
    (b"", "application/json"),
    (b"model=demo&prompt=hi", "application/x-www-form-urlencoded"),
    (b'{"model": "demo", "prompt": "hi"}', "text/plain"),
], ids=["deep", "nan", "inf", "utf8", "empty", "form", "text-plain"])
def test_malformed_bodies_are_400_at_the_node(server, path, content, content_type):
    assert_error(post(server, path, content=content, headers={"Content-Type": content_type}), 400)


def test_405_keeps_its_allow_header(server):
    r = httpx.delete(server.url + "/v1/completions", headers=server.headers(), timeout=30)
    assert_error(r, 405)
    assert "POST" in r.headers["Allow"]


@pytest.mark.parametrize("field, value", [
    ("seed", 10 ** 29), ("seed", -(2 ** 63) - 1), ("temperature", 1e39), ("priority", 2 ** 63),
    ("stop_token_ids", [-1]), ("prompt", "\ud800 unpaired"), ("stop", ["\udfff"]), ("user", "\ud83d"),
    ("frequency_penalty", 10 ** 400),
])
def test_values_the_engine_cannot_take_are_400_naming_the_param(server, field, value):
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 2, field: value})
    assert_error(post(server, "/v1/completions", content=body.encode(),
                      headers={"Content-Type": "application/json"}), 400, param=field)


def test_a_negative_seed_is_taken_and_reproducible(server):
    body = {"model": "demo", "prompt": "Once", "max_tokens": 4, "seed": -(2 ** 63), "return_token_ids": True}
    first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["token_ids"] == second.json()["choices"][0]["token_ids"]


def test_n_with_a_seed_at_the_top_of_the_range_is_400(server):
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2 ** 63 - 1}
    assert_error(post(server, "/v1/completions", body), 400, param="seed")


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
])
def test_a_prefill_request_is_one_plain_choice(server, extra, param):
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
            **extra}
    assert_error(post(server, "/v1/completions", body), 400, param=param)
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}, **extra}
    chat.pop("prompt", None)
    if param != "prompt":
        assert_error(post(server, "/v1/chat/completions", chat), 400, param=param)


def test_a_request_that_fails_in_the_sampler_fails_alone(server):
    """Item 3: a request whose own sampling fails (here a stop token id beyond the vocabulary while min_tokens
    holds, which only the engine can check) never fails the valid requests that share its steps."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as c:
            good = {"model": "demo", "prompt": "The sky is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            bad = {**good, "min_tokens": 4, "stop_token_ids": [10 ** 6]}
            return await asyncio.gather(*[c.post("/v1/completions", json=bad if i % 4 == 1 else good)
                                          for i in range(8)])

    responses = asyncio.run(run())
    for i, r in enumerate(responses):
        if i % 4 == 1:
            assert_error(r, 400, param="stop_token_ids")
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    assert post(server, "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_every_server_side_status_has_a_server_error_type():
    """A 5xx is never typed as the client's fault (a client that retries only server errors must see them)."""
    from pdpool.server.errors import APIError

    for status in (500, 501, 502, 504, 507):
        assert APIError("upstream failed", status=status).body()["error"]["type"] == "internal_server_error"
    assert APIError("busy", status=503).type == "service_unavailable"
    for status in (400, 405, 409, 413, 415, 422):
        assert APIError("bad", status=status).type == "invalid_request_error"
