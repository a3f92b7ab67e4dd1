"""vLLM's beam search (``use_beam_search``) through the OpenAI API with the official client: the n best beams in
score order, width 1 as greedy, chat streamed, the 400s, and no KV kept when the client goes away mid-search."""

from __future__ import annotations

import httpx
import pytest

from test_server_errors import assert_error, post
from test_server_metrics import idle, wait_for

PROMPT = "The capital of France is"


def beams(client, n: int, **kw):
    return client.completions.create(model="demo", prompt=PROMPT, n=n, temperature=0,
                                     extra_body={"use_beam_search": True, "return_token_ids": True, **kw.pop("extra",
                                                                                                            {})}, **kw)


def sequence_logprob(server, prompt_ids: list[int], output_ids: list[int]) -> float:
    """The model's log probability of ``output_ids`` after ``prompt_ids``: the scoring call (echo, no tokens)."""
    r = post(server, "/v1/completions", {"model": "demo", "prompt": prompt_ids + output_ids, "max_tokens": 0,
                                         "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids):])


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_n_beams_are_distinct_and_in_score_order(server, client, length_penalty):
    r = beams(client, 3, max_tokens=8, extra={"length_penalty": length_penalty})
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, texts
    scores = []
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert c.finish_reason in ("length", "stop") and len(ids) <= 8
        total = len(c.model_extra["prompt_token_ids"]) + len(ids)
        scores.append(sequence_logprob(server, c.model_extra["prompt_token_ids"], ids) / total ** length_penalty)
    assert scores == sorted(scores, reverse=True), scores
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    again = beams(client, 3, max_tokens=8, extra={"length_penalty": length_penalty})
    assert [c.text for c in again.choices] == texts   # deterministic


def test_width_one_is_greedy(client):
    greedy = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={
        "ignore_eos": True})
    beam = beams(client, 1, max_tokens=12, extra={"ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text
    assert beam.choices[0].finish_reason == "length"


def test_the_best_beam_scores_at_least_the_greedy_answer(server, client):
    greedy = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    best = beams(client, 4, max_tokens=8, extra={"ignore_eos": True}).choices[0]
    prompt_ids = best.model_extra["prompt_token_ids"]
    assert (sequence_logprob(server, prompt_ids, best.model_extra["token_ids"])
            >= sequence_logprob(server, prompt_ids, greedy.choices[0].model_extra["token_ids"]) - 1e-4)


def test_chat_beams_whole_and_streamed(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    whole = client.chat.completions.create(model="demo", messages=messages, n=2, max_tokens=16, temperature=0,
                                           extra_body={"use_beam_search": True})
    assert len(whole.choices) == 2 and whole.choices[0].message.content != whole.choices[1].message.content
    texts, finish = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(model="demo", messages=messages, n=2, max_tokens=16, temperature=0,
                                                stream=True, extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert [finish[0], finish[1]] == [c.finish_reason for c in whole.choices]


def test_several_prompts_each_get_their_beams(client):
    r = client.completions.create(model="demo", prompt=[PROMPT, "The sky is"], n=2, max_tokens=5, temperature=0,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = beams(client, 2, max_tokens=5)
    assert [c.text for c in r.choices[:2]] == [c.text for c in alone.choices]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"n": 11}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stop": ["."]}, "stop"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"top_p": 0.5}, "top_p"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"length_penalty": "long"}, "length_penalty"),
])
def test_what_beam_search_cannot_take_is_400(server, extra, param):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    assert_error(post(server, "/v1/completions", body), 400, param=param)


def test_a_client_gone_mid_search_leaves_no_kv(server):
    total = idle(server)["pdpool_kv_cache_free_blocks"]
    body = {"model": "demo", "prompt": "List every prime number.", "max_tokens": 300, "ignore_eos": True, "n": 4,
            "use_beam_search": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=2.0)
        raise AssertionError("300 steps of 4 beams should take longer than 2 s on a CPU")
    except httpx.ReadTimeout:
        pass  # the client hangs up
    m = wait_for(lambda: (m := server.metrics())["pdpool_num_requests_running"] == 0
                 and m["pdpool_num_requests_waiting"] == 0 and m["pdpool_kv_cache_free_blocks"] == total and m)
    assert m["pdpool_kv_cache_free_blocks"] == total
    ok = post(server, "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 2, "n": 2,
                                          "use_beam_search": True})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_the_score_is_vllms_and_any_finite_penalty_is_taken():
    import math

    from pdpool.server.beam_search import Beam, score

    assert score(Beam([1, 2, 3, 9], -2.0), 9, 1.0) == -2.0 / 3   # a final EOS is not counted
    assert score(Beam([1, 2, 3, 4], -2.0), 9, 0.5) == -1.0
    for penalty in (1e308, -1e308, 800.0):
        assert all(math.isfinite(score(Beam([1] * n, -1.0), 9, penalty)) for n in (1, 2, 3))
