"""Completions' ``echo`` with ``logprobs``, and ``max_tokens: 0`` with ``echo``: the legacy scoring call that
lm-evaluation-harness's ``local-completions`` makes (token-id prompts, ``echo``, ``logprobs``, ``max_tokens`` 0 or
1). The prompt's logprobs are HF transformers' on the demo model; streamed and whole answers agree."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "The three primary colors are red, yellow and blue, and mixing two of them gives"
TOL = 2e-3   # float32 engine vs float32 HF: different matmul orders


def complete(server, **body) -> dict:
    r = httpx.post(server.base_url + "/completions", json={"model": "demo", "temperature": 0, **body},
                   headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def expected_prompt_logprobs(hf_reference, ids: list[int]) -> list[float]:
    lp = hf_reference.logprobs(ids[:1], ids[1:])
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.parametrize("prompt_form", ["text", "ids"])
def test_echo_only_scores_the_prompt(server, hf_reference, prompt_form):
    ids = hf_reference.encode(PROMPT)
    body = complete(server, prompt=PROMPT if prompt_form == "text" else ids, echo=True, logprobs=1, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == (PROMPT if prompt_form == "text" else hf_reference.tokenizer.decode(ids))
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected_prompt_logprobs(hf_reference, ids), abs=TOL)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert all(len(top) in (1, 2) and tok in top for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert choice["finish_reason"] == "length"


def test_echo_with_generation_prepends_the_prompts_logprobs(server, hf_reference):
    ids = hf_reference.encode(PROMPT)
    plain = complete(server, prompt=PROMPT, logprobs=2, max_tokens=3)["choices"][0]
    echoed = complete(server, prompt=PROMPT, logprobs=2, max_tokens=3, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp, gen = echoed["logprobs"], plain["logprobs"]
    n = len(ids)
    assert lp["tokens"][n:] == gen["tokens"]     # (the plain request read its prompt from the prefix cache)
    assert lp["token_logprobs"][n:] == pytest.approx(gen["token_logprobs"], abs=1e-4)
    for mine, theirs in zip(lp["top_logprobs"][n:], gen["top_logprobs"]):
        assert mine == pytest.approx(theirs, abs=1e-4)
    assert lp["token_logprobs"][1:n] == pytest.approx(expected_prompt_logprobs(hf_reference, ids), abs=TOL)
    assert lp["text_offset"][n] == len(PROMPT)     # the generated text starts after the echoed prompt


def test_lm_eval_style_batch_and_stream_agree(server, hf_reference):
    """A batch of token-id prompts scored at once (lm-eval's loglikelihood requests), then the same streamed."""
    prompts = [hf_reference.encode(PROMPT), hf_reference.encode("Water boils at one hundred degrees")]
    whole = complete(server, prompt=prompts, echo=True, logprobs=1, max_tokens=1)
    for choice, ids in zip(whole["choices"], prompts):
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + 1
        assert got[1:len(ids)] == pytest.approx(expected_prompt_logprobs(hf_reference, ids), abs=TOL)
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(), timeout=120,
                      json={"model": "demo", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                            "temperature": 0, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    by_choice: dict[int, dict] = {}
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            acc = by_choice.setdefault(c["index"], {"text": "", "token_logprobs": []})
            acc["text"] += c["text"]
            if c["logprobs"]:
                acc["token_logprobs"] += c["logprobs"]["token_logprobs"]
    for choice in whole["choices"]:
        got = by_choice[choice["index"]]
        assert got["text"] == choice["text"]
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_the_openai_client_and_refusals(server, client):
    r = client.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0
    bad = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                     json={"model": "demo", "prompt": PROMPT, "max_tokens": 0})      # no echo: nothing to answer
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    handoff = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                         json={"model": "demo", "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1,
                               "kv_transfer_params": {"do_remote_decode": True}})
    assert handoff.status_code == 400 and handoff.json()["error"]["param"] == "kv_transfer_params"


def test_vllm_prompt_logprobs_field(server, hf_reference):
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) the token's own logprob and rank and the N
    best; on each completion choice, at a chat answer's top level, and in a stream's chunk with the first token."""
    import torch

    ids = hf_reference.encode(PROMPT)
    ref = hf_reference.logprobs(ids[:1], ids[1:])
    body = complete(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=3)
    got = body["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL)
        assert own["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]] + TOL).sum()) + 1 or \
            abs(own["rank"] - (int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1)) <= 1   # a near-tie may swap
        best = torch.topk(ref[i - 1], 3).indices.tolist()
        assert {r["rank"] for t, r in entry.items() if int(t) in best} >= {1}
        assert len(entry) in (3, 4) and own["decoded_token"] == hf_reference.tokenizer.decode([ids[i]])
    assert body["choices"][0]["text"] == complete(server, prompt=PROMPT, max_tokens=2)["choices"][0]["text"]
    r = httpx.post(server.base_url + "/chat/completions", headers=server.headers(), timeout=120,
                   json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                         "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(), timeout=120,
                      json={"model": "demo", "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 3,
                            "stream": True}) as s:
        import json

        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(streamed) == 1 and [sorted(e) if e else e for e in streamed[0]] == \
        [sorted(e) if e else e for e in got]
    for bad in (-1, 21, "3", 1.5):
        r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=60,
                       json={"model": "demo", "prompt": PROMPT, "prompt_logprobs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", bad
