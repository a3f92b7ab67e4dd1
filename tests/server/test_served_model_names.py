"""Several served names, as ``vllm serve --served-model-name a b`` serves them (vLLM 0.32's
``OpenAIServingModels``): a request may name any, ``/v1/models`` lists them all, and every answer carries the first
(completions, chat, the Responses and Messages APIs, streamed or not). The node here takes its names from a
``--config`` file, one of whose settings a flag overrides."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_errors import assert_error, post

NAMES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def named(launch_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "serve.yaml"
    path.write_text("served-model-name: [alpha, beta, gamma]\nmax-model-len: 256\ndtype: float32\n")
    srv = launch_server("--config", str(path), "--max-model-len", "384", "--num-kv-blocks", "64",
                        "--max-num-seqs", "4")
    yield srv
    srv.stop()


def test_models_lists_every_name(named, demo_model_dir):
    cards = httpx.get(named.url + "/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == NAMES
    assert {c["max_model_len"] for c in cards} == {384}           # the flag won over the file's 256
    assert all(c["root"] for c in cards) and len({c["root"] for c in cards}) == 1
    for name in NAMES:
        r = httpx.get(f"{named.url}/v1/models/{name}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == name
    assert_error(httpx.get(named.url + "/v1/models/demo", timeout=30), 404)


@pytest.mark.parametrize("name", NAMES[1:])
def test_any_name_is_served_and_the_answer_carries_the_first(named, name):
    client = named.client()
    completion = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
    assert completion.model == NAMES[0]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == NAMES[0]
    chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True))
    assert chunks and {c.model for c in chunks} == {NAMES[0]}
    assert client.responses.create(model=name, input="Hi", max_output_tokens=2).model == NAMES[0]
    message = post(named, "/v1/messages", {"model": name, "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert message.status_code == 200 and message.json()["model"] == NAMES[0], message.text
    assert post(named, "/tokenize", {"model": name, "prompt": "Hi"}).status_code == 200


def test_a_name_not_served_is_a_404(named):
    err = assert_error(post(named, "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 1}), 404,
                       param="model")
    assert all(name in err["message"] for name in NAMES)


def test_openapi_offers_every_name(named):
    spec = httpx.get(named.url + "/openapi.json", timeout=30).json()
    assert NAMES[0] in json.dumps(spec) and NAMES[2] in json.dumps(spec)
