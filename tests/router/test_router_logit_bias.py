"""``logit_bias`` through ``pdpool router`` to a prefill and a decode node (real Redis and NIXL, the demo model on
CPU): the prefill node samples the first token with the bias, the decode node the rest, and an id outside the
vocabulary is the router's own 400, before any routing."""

from __future__ import annotations

import pytest
from cluster import running_nodes
from routers import redis_flags

pytestmark = pytest.mark.timeout(600)

FORCED = 1234  # a token the demo model does not pick for these prompts unbiased
DISAGGREGATED = 'pdpool_router_requests_total{decision="disaggregated"}'


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, redis_module):
    """One prefill and one decode node: all this module needs (the package's cluster has two decode nodes)."""
    spec = {"p0": ("prefill", []), "d0": ("decode", [])}
    with running_nodes(spec, tmp_path_factory.mktemp("nodes"), redis_module.url) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def router(cluster, redis_module, start_router):
    return start_router(redis_flags(redis_module.url), name="router-bias")


def _prompt(topic: str) -> str:  # a new prompt per request: nothing cached on the decode node, so it disaggregates
    return (f"A long report about {topic} starts with its history, then describes the people who worked on it, the "
            f"places where it happened and the results that were published over the following years.")


def test_logit_bias_survives_the_prefill_to_decode_handoff(router):
    client = router.client()
    extra = {"return_token_ids": True, "ignore_eos": True}
    free = client.completions.create(model="demo", prompt=_prompt("bridges"), max_tokens=4, temperature=0,
                                     extra_body=extra)
    assert FORCED not in free.choices[0].model_extra["token_ids"]
    before = router.value(DISAGGREGATED)
    done = client.completions.create(model="demo", prompt=_prompt("rivers"), max_tokens=4, temperature=0,
                                     logit_bias={str(FORCED): 100}, extra_body=extra)
    assert done.choices[0].model_extra["token_ids"] == [FORCED] * 4  # the first from p0, the rest from d0
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": _prompt("trains")}],
                                          max_tokens=3, temperature=0, logit_bias={str(FORCED): 100},
                                          stream=True, extra_body=extra)
    assert [t for c in chat if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []] == \
        [FORCED] * 3
    assert router.value(DISAGGREGATED) == before + 2


def test_an_id_outside_the_vocabulary_is_the_routers_400(router):
    r = router.post("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2,
                                        "logit_bias": {"49152": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "must hold token ids" in r.json()["error"]["message"]  # the front end's wording (a node's differs)


def test_allowed_token_ids_survive_the_handoff(router):
    """vLLM's allowed_token_ids: the prefill node's first token and the decode node's rest are all allowed ones."""
    allowed = [FORCED, 28, 314]
    before = router.value(DISAGGREGATED)
    done = router.client().completions.create(
        model="demo", prompt=_prompt("harbours"), max_tokens=5, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "allowed_token_ids": allowed})
    assert set(done.choices[0].model_extra["token_ids"]) <= set(allowed)
    assert router.value(DISAGGREGATED) == before + 1
    for bad in ([], [49152], "28"):
        r = router.post("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2,
                                            "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", (bad, r.text)


def test_bad_words_survive_the_handoff(router):
    """The prefill node bans a one-token bad word for the first token, the decode node for the rest."""
    client = router.client()
    extra = {"return_token_ids": True, "ignore_eos": True}
    free = client.completions.create(model="demo", prompt=_prompt("castles"), max_tokens=6, temperature=0,
                                     extra_body=extra)
    word = free.choices[0].text.split()[0]
    before = router.value(DISAGGREGATED)
    done = client.completions.create(model="demo", prompt=_prompt("castles") + " Again:", max_tokens=6,
                                     temperature=0, extra_body={**extra, "bad_words": [word]})
    assert word not in done.choices[0].text.split()
    assert router.value(DISAGGREGATED) == before + 1
