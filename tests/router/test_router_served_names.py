"""``pdpool router --served-model-name a b``, as ``pdpool serve`` and vLLM take it: a request naming any of the
names is routed (the nodes are asked for the first, the name they serve, and the answer carries it, as vLLM's
does), and ``/v1/models`` lists a card per name. A real colocated node that serves "demo" alone."""

from __future__ import annotations

import httpx
import pytest

from pdpool.router import settings

NAMES = ["demo", "my-alias"]


@pytest.fixture(scope="module")
def router(colocated_node, start_router):
    return start_router(["--both", colocated_node.url, "--served-model-name", *NAMES], name="router-names")


def test_one_name_and_several_parse():
    one, _ = settings.load(["--served-model-name", "demo", "--both", "http://n0:8000"], environ={})
    assert one.served_model_names == ["demo"] and one.served_model_name == "demo"
    several, _ = settings.load(["--served-model-name", "a", "b", "--both", "http://n0:8000"], environ={})
    assert several.served_model_names == ["a", "b"] and several.served_model_name == "a"
    default, _ = settings.load(["--both", "http://n0:8000"], environ={})
    assert default.served_model_names == ["demo"]


def test_every_name_is_listed_and_retrieved(router):
    cards = httpx.get(f"{router.base_url}/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == NAMES
    for name in NAMES:
        r = httpx.get(f"{router.base_url}/models/{name}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == name, r.text
    assert httpx.get(f"{router.base_url}/models/other", timeout=30).status_code == 404


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Name a color:", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3,
                              "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3}),
])
def test_a_request_naming_the_second_name_is_answered_as_the_first(router, path, body):
    r = router.post(path, {**body, "model": "my-alias", "temperature": 0})
    assert r.status_code == 200, r.text
    same = router.post(path, {**body, "model": "demo", "temperature": 0})
    assert r.text.count('"model":"demo"') + r.text.count('"model": "demo"') >= 1, r.text[:500]
    if not body.get("stream"):
        assert r.json()["model"] == "demo"
        key = "content" if path == "/v1/messages" else "choices"
        assert r.json()[key] == same.json()[key]
    assert router.post(path, {**body, "model": "other"}).status_code == 404
