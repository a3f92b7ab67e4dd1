"""Chat's ``add_generation_prompt`` and vLLM's ``continue_final_message``: the front end renders what transformers
renders (vLLM's own rendering), on arbitrary conversations, and the node serves it, refusing what vLLM refuses."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
ROLES = st.sampled_from(["system", "user", "assistant"])


def hf_render(hf_tokenizer, messages, add_generation_prompt, continue_final_message=False) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT}), max_size=3), last=TEXT,
       add_generation_prompt=st.booleans())
def test_rendering_matches_transformers(frontend, hf_tokenizer, history, last, add_generation_prompt):
    messages = [*history, {"role": "assistant", "content": last}]
    assert frontend.render_chat(messages, add_generation_prompt) == \
        hf_render(hf_tokenizer, messages, add_generation_prompt)
    continued = frontend.render_chat(messages, False, True)
    assert continued == hf_render(hf_tokenizer, messages, False, True)
    assert continued.endswith(last) and not continued.endswith("<|im_end|>\n")  # the turn stays open


MESSAGES = [{"role": "user", "content": "Name two planets."},
            {"role": "assistant", "content": "Sure: Mars and"}]


def post_chat(server, **body) -> httpx.Response:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            **body}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120,
                      headers=server.headers())


@pytest.mark.parametrize("flags, hf_flags", [
    ({"add_generation_prompt": False, "continue_final_message": True}, (False, True)),
    ({"add_generation_prompt": False}, (False, False)),
    ({}, (True, False)),
])
def test_the_node_prompts_what_transformers_renders(server, hf_tokenizer, flags, hf_flags):
    r = post_chat(server, **flags)
    assert r.status_code == 200, r.text
    expected = hf_tokenizer(hf_render(hf_tokenizer, MESSAGES, *hf_flags), add_special_tokens=False)["input_ids"]
    assert r.json()["choices"][0]["prompt_token_ids"] == expected


@pytest.mark.parametrize("flags, param", [
    ({"continue_final_message": True}, "add_generation_prompt"),        # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": MESSAGES[:1]}, "messages"),                            # the last message is the user's
])
def test_refused_as_vllm_refuses(server, flags, param):
    r = post_chat(server, **flags)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
