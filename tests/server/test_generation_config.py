"""``--generation-config`` and ``--override-generation-config``, as vLLM (0.32) has them: a request's unset sampling
fields default to the model's ``generation_config.json`` (Qwen3's temperature 0.6, top_p 0.95, top_k 20, say), not
to the neutral values; its ``max_new_tokens`` is a chat's budget when the chat gives none."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings, strategies as st

from pdpool import config
from pdpool.engine.sampling_params import generation_defaults
from pdpool.frontend import DEFAULTABLE, GenerationDefaults
from pdpool.server import protocol
from pdpool.server.errors import APIError

MODEL = "demo"
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0}
QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 151643,
         "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def folder(tmp_path, generation: dict, name: str = "model"):
    path = tmp_path / name
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_the_sources_read_as_vllm_reads_them(tmp_path):
    model = folder(tmp_path, {**QWEN3, "max_new_tokens": 512, "repetition_penalty": 1.05})
    auto = GenerationDefaults.read(model)
    assert auto.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert (auto.max_tokens, auto.max_tokens_cap) == (512, None)
    assert not GenerationDefaults.read(model, "vllm")
    other = folder(tmp_path, {"temperature": 0.3, "max_new_tokens": 64}, "other")
    from_folder = GenerationDefaults.read(model, str(other))   # a folder's max_new_tokens caps every request
    assert from_folder.sampling == {"temperature": 0.3} and from_folder.max_tokens_cap == 64
    over = GenerationDefaults.read(model, "auto", {"temperature": 0.1, "top_k": None, "max_new_tokens": 8})
    assert over.sampling == {"temperature": 0.1, "top_p": 0.95, "repetition_penalty": 1.05}
    assert (over.max_tokens, over.max_tokens_cap) == (8, 8)
    with pytest.raises(ValueError, match="no generation_config.json"):
        GenerationDefaults.read(model, str(tmp_path / "nowhere"))


def test_bad_defaults_stop_the_load_and_a_bad_override_is_a_config_error(tmp_path):
    model = folder(tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults(model, config.ModelConfig())
    with pytest.raises(config.ConfigError, match="must be a JSON object"):
        config.build(override_generation_config="[1]")


unset = st.sampled_from(["absent", "null"])
value_of = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
            "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.1, 2)}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["completion", "chat"]), beam=st.booleans(),
       max_tokens=st.one_of(st.none(), st.integers(1, 40)), cap=st.one_of(st.none(), st.integers(1, 30)))
def test_a_requests_own_values_win_and_its_unset_fields_take_the_defaults(data, kind, beam, max_tokens, cap):
    defaults = GenerationDefaults({name: data.draw(value_of[name]) for name in DEFAULTABLE
                                   if data.draw(st.booleans())}, data.draw(st.one_of(st.none(), st.integers(1, 99))),
                                  cap)
    body = {"model": MODEL, "use_beam_search": beam}
    for name in DEFAULTABLE:
        # a beam search refuses the fields it ignores (as vLLM's): only its temperature may be set
        how = data.draw(unset if beam and name != "temperature" else st.one_of(unset, value_of[name]))
        if how == "null":
            body[name] = None
        elif how != "absent":
            body[name] = how
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        req = protocol.parse_chat(body, [MODEL], lambda messages, *flags: "hi")
    else:
        body["prompt"] = "hi"
        req = protocol.parse_completion(body, [MODEL])
    protocol.apply_generation_defaults(req, defaults, max_model_len=64)
    for name in DEFAULTABLE:
        if body.get(name) is not None:
            want = body[name]
        elif name in defaults.sampling and (name == "temperature" or not beam):
            want = defaults.sampling[name]
        else:
            want = NEUTRAL[name]
        assert getattr(req.params, name) == want, name
    budget = max_tokens if max_tokens is not None else (
        min(defaults.max_tokens, 64) if kind == "chat" and defaults.max_tokens is not None else 16 if kind == "completion"
        else None)
    if cap is not None:
        budget = min(budget or 64, cap)
    assert req.params.max_tokens == budget


def test_min_tokens_over_the_cap_is_a_400_naming_it():
    req = protocol.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 20},
                              [MODEL], lambda messages, *flags: "hi")
    with pytest.raises(APIError) as info:
        protocol.apply_generation_defaults(req, GenerationDefaults({}, None, 5), max_model_len=64)
    assert info.value.param == "min_tokens" and "generation defaults" in str(info.value)


def test_a_node_applies_the_models_generation_config(launch_server, demo_model_dir, tmp_path):
    """A copy of the demo model whose generation_config.json says temperature 0 and max_new_tokens 5: a chat that
    gives neither is greedy and 5 tokens long; a completion keeps its 16; a request's own values win."""
    model = tmp_path / "demo-generation"
    shutil.copytree(demo_model_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0,
                                                              "max_new_tokens": 5}))
    node = launch_server("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                         "--num-kv-blocks", "64", "--max-num-seqs", "4")
    try:
        client = node.client()
        messages = [{"role": "user", "content": "Name three colours."}]
        plain = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True})
        assert plain.usage.completion_tokens == 5 and plain.choices[0].finish_reason == "length"
        greedy = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5,
                                                extra_body={"ignore_eos": True})
        assert plain.choices[0].message.content == greedy.choices[0].message.content
        longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                                extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 9
        completion = client.completions.create(model=MODEL, prompt="Colours:", extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 16
    finally:
        node.stop()
