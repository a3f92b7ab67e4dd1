"""Every failure is OpenAI error JSON with the right status; the server keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdpool.server.errors import error_middleware



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


def test_prompt_plus_max_tokens_over_max_model_len_is_400_with_the_numbers(server, client):
    max_model_len = server.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=[1] * 500, max_tokens=100)
    message = str(info.value)
    assert str(max_model_len) in message and "500" in message and "100" in message
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
        assert err["type"] == "internal_server_error" and "boom" in err["message"]
        assert (await c.get("/fine")).status == 200
