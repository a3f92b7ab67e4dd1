"""Hypothesis strategies for fuzzing an OpenAI-compatible server (a node, or the router in front of nodes).

``fuzz_cases(model, api_key)`` draws one HTTP exchange: a body of the completions, chat, responses or (Anthropic's)
messages endpoint with fields of wrong types, missing or extra, extreme and non-finite numbers; raw bodies that are
broken JSON, too deeply nested, not UTF-8, empty or large; wrong content types, methods and paths; and clients that
vanish (a stream closed after its first bytes, a request closed before its answer). ``send(base_url, case)``
performs it and ``check_answer`` asserts what any answer must satisfy: no 5xx, every 4xx an OpenAI error object
(Anthropic's on /v1/messages), a 200 a whole JSON body or an SSE stream that ends in ``[DONE]`` (a Responses
stream: in ``response.completed``; a Messages stream: in ``message_stop``) without an error event. ``valid_completion`` is a request that
must succeed: run it beside the fuzz cases to see that a bad request never fails its batch-mates.

Generated values keep valid requests cheap (``max_tokens`` at most 4, ``n`` at most 3) so that hundreds of
cases run in minutes on a CPU node.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from hypothesis import strategies as st

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
RESPONSES = "/v1/responses"
MESSAGES_PATH = "/v1/messages"   # Anthropic's Messages API: its errors in Anthropic's shape


@dataclass
class FuzzCase:
    method: str
    path: str
    content: bytes
    headers: dict = field(default_factory=dict)
    vanish: str | None = None  # None | "after_first_bytes" (a stream) | "before_answer"
    label: str = ""  # what was fuzzed, for the failure message

    def __repr__(self) -> str:
        body = self.content[:300] + (b"..." if len(self.content) > 300 else b"")
        return f"FuzzCase({self.label}: {self.method} {self.path} {self.headers} {body!r} vanish={self.vanish})"


# ---- values -----------------------------------------------------------------------------------------

EXTREME_INTS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**29, -(10**29),
                10**400]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e-7, 0.5, 1.5, 2.0000001, 1e38, 3.5e38, 1e39, 1e308, -1e308,
                  float("nan"), float("inf"), float("-inf")]  # json.dumps writes NaN/Infinity: not JSON, a 400


def scalars() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(EXTREME_INTS),
                     st.floats(width=64), st.sampled_from(EXTREME_FLOATS), st.text(max_size=12))


def json_values() -> st.SearchStrategy:
    return st.recursive(scalars(), lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def numbers(lo: float, hi: float) -> st.SearchStrategy:
    """Mostly in [lo, hi], often extreme, sometimes not a number at all."""
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.sampled_from(EXTREME_FLOATS),
                     st.sampled_from(EXTREME_INTS), json_values())


def small_ints(lo: int, hi: int) -> st.SearchStrategy:
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.sampled_from(EXTREME_INTS),
                     st.sampled_from([2.0, 2.5, "3", True, None, [1]]))


# Strings a client may send; json.dumps writes the unpaired surrogates as \ud800 escapes.
TEXTS = st.one_of(st.text(max_size=40), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\U0001f600", "é" * 50,
                                                         "<|endoftext|>", "<|im_start|>user"]))

PROMPTS = st.one_of(
    st.sampled_from(["Hi", "The sky is", "1, 2, 3,"]), TEXTS,
    st.lists(st.integers(0, 2000), min_size=1, max_size=20),
    st.lists(st.lists(st.integers(0, 2000), min_size=1, max_size=8), min_size=1, max_size=2),
    st.lists(st.sampled_from(["a", "b c"]), min_size=1, max_size=2),
    st.sampled_from([[], [[]], [10**9], [-1], [[1], "x"], {"a": 1}, 7, [1.5], [True], "word " * 600]),
    json_values())

MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "Say hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                    "content": TEXTS}), min_size=1, max_size=3),
    st.just([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}]),
    st.sampled_from([[], [{}], [{"role": 5}], [{"content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": "hi " * 700}], "hi", None]),
    json_values())

STOPS = st.one_of(st.none(), TEXTS, st.lists(TEXTS, max_size=3), json_values())
TOKEN_ID_LISTS = st.one_of(st.lists(st.integers(-3, 2**40), max_size=3),
                           st.lists(st.sampled_from(EXTREME_INTS), max_size=2), json_values())
# logit_bias: valid maps (ids in the demo vocabulary, biases in and beyond [-100, 100]) and bad ones (ids outside
# the vocabulary or not integers, values that are no finite number), beside arbitrary JSON.
BIAS_KEYS = st.one_of(st.integers(0, 49151).map(str), st.sampled_from(["-1", "49152", "10" * 12, "1.5", "x", "",
                                                                       " 7", "+3", "0x10", "\u0661"]))
BIAS_VALUES = st.one_of(st.floats(-100, 100), st.integers(-200, 200), st.sampled_from(EXTREME_FLOATS),
                        st.sampled_from(EXTREME_INTS), st.sampled_from([True, "1", None, [1], {}]))
LOGIT_BIASES = st.one_of(st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
                         st.dictionaries(BIAS_KEYS, BIAS_VALUES, max_size=4), st.just({}), st.none(),
                         json_values())
KV_PARAMS = st.one_of(st.just({"do_remote_decode": True}), st.just({"do_remote_prefill": True}),
                      st.just({"do_remote_decode": True, "do_remote_prefill": True}),
                      st.dictionaries(st.sampled_from(["do_remote_decode", "do_remote_prefill", "remote_block_ids",
                                                       "remote_engine_id", "version"]), json_values(), max_size=3),
                      json_values())

# Structured output: schemas and regexes that compile, that do not, and that give out while generating (a bounded
# repeat far past llguidance's lexer limit; min_tokens beyond a grammar's end).
SCHEMAS = st.one_of(st.sampled_from([{"type": "object"}, {"type": "integer", "minimum": 5, "maximum": 3},
                                     {"enum": ["a", 1, None]}, {"type": "string", "maxLength": 0}, {"not": {}},
                                     {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, True, False,
                                     {"$ref": "#/nope"}, {"type": "nonsense"}]),
                    st.dictionaries(st.sampled_from(["type", "properties", "required", "enum", "pattern"]),
                                    json_values(), max_size=2))
REGEXES = st.one_of(st.sampled_from(["[0-9]{2}", "(a|b)+!", "[0-9", "(?!x)", "x{1000000}", "", "\\d{3}x{99999}",
                                     "[^\\s\\S]"]), TEXTS)
# vLLM's structural tags: valid ones, a begin no trigger starts, empty lists, an empty trigger, bad schemas, and
# xgrammar's "format" shape (refused)
_TAG_STRUCTURES = st.lists(st.fixed_dictionaries({"begin": st.sampled_from(["<f>", "JSON=", "", "<g"]),
                                                  "end": st.sampled_from(["</f>", ";", ""])},
                                                 optional={"schema": SCHEMAS}), max_size=2)
STRUCTURAL_TAGS = st.one_of(
    st.fixed_dictionaries({"structures": _TAG_STRUCTURES,
                           "triggers": st.lists(st.sampled_from(["<f", "JSON", "", "<"]), max_size=2)}),
    st.fixed_dictionaries({"format": json_values()}),
    st.dictionaries(st.sampled_from(["structures", "triggers", "format"]), json_values(), max_size=2))
CONSTRAINTS = {"json": SCHEMAS, "regex": REGEXES, "json_object": st.one_of(st.booleans(), json_values()),
               "choice": st.one_of(st.lists(TEXTS, max_size=3), json_values()),
               "grammar": st.one_of(st.sampled_from(['start: "a" | "b"', 'root ::= [0-9]+', "start: undefined",
                                                     ""]), TEXTS),
               "disable_any_whitespace": st.one_of(st.booleans(), json_values()),
               "structural_tag": st.one_of(STRUCTURAL_TAGS, STRUCTURAL_TAGS.map(json.dumps), json_values())}

# Request chat templates (refused unless the node trusts them): ones that render, that do not parse, that fail
# while rendering, that render nothing, and one that renders past any context length.
CHAT_TEMPLATES = st.one_of(
    st.sampled_from(["{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
                     "{% for m in messages %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
                     "{% for %}", "{{ undefined_thing.attr }}", "{{ raise_exception('no') }}", "", "{{ 1/0 }}",
                     "{% for i in range(100000) %}word {% endfor %}", "{{ messages[99] }}",
                     "{{ enable_thinking }}|{{ tools }}|{% for m in messages %}{{ m.content }}{% endfor %}"]),
    TEXTS, json_values())

COMMON_FIELDS = {
    "model": st.one_of(st.sampled_from(["gpt-17", "", "DEMO"]), json_values()),
    "max_tokens": small_ints(1, 4),
    "temperature": numbers(0, 2), "top_p": numbers(0, 1), "top_k": small_ints(-2, 50), "min_p": numbers(0, 1),
    "presence_penalty": numbers(-2, 2), "frequency_penalty": numbers(-2, 2), "repetition_penalty": numbers(0, 2),
    "seed": st.one_of(st.integers(-(2**64), 2**64), st.sampled_from(EXTREME_INTS), json_values()),
    "n": small_ints(1, 3), "best_of": small_ints(1, 3), "min_tokens": small_ints(0, 4),
    "stop": STOPS, "stop_token_ids": TOKEN_ID_LISTS, "ignore_eos": st.one_of(st.booleans(), json_values()),
    "stream": st.one_of(st.booleans(), json_values()),
    "stream_options": st.one_of(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                    "continuous_usage_stats": st.booleans()}),
                                json_values()),
    "priority": st.one_of(st.integers(-5, 5), st.sampled_from(EXTREME_INTS), json_values()),
    "cache_salt": st.one_of(TEXTS, json_values()), "user": st.one_of(TEXTS, json_values()),
    "kv_transfer_params": KV_PARAMS, "logit_bias": LOGIT_BIASES,
    "prompt_logprobs": small_ints(-1, 21), "truncate_prompt_tokens": small_ints(-2, 6),
    "allowed_token_ids": st.one_of(TOKEN_ID_LISTS, st.lists(st.integers(0, 49151), min_size=1, max_size=3)),
    "bad_words": st.one_of(st.lists(TEXTS, max_size=3), json_values()),
    "return_token_ids": st.one_of(st.booleans(), json_values()),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.one_of(st.booleans(), json_values()),
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}, None]),
                                 STRUCTURAL_TAGS.map(lambda tag: {"type": "structural_tag", **tag}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"),
                                                        "json_schema": st.fixed_dictionaries(
                                                            {"name": st.just("x")}, optional={"schema": SCHEMAS})}),
                                 json_values()),
    "structured_outputs": st.one_of(st.fixed_dictionaries({}, optional=CONSTRAINTS), json_values()),
    "guided_json": st.one_of(SCHEMAS, json_values()), "guided_regex": st.one_of(REGEXES, json_values()),
    "guided_choice": CONSTRAINTS["choice"], "guided_grammar": CONSTRAINTS["grammar"],
    "return_tokens_as_token_ids": st.one_of(st.booleans(), json_values()),
    "use_beam_search": st.one_of(st.booleans(), json_values()), "length_penalty": numbers(-2, 2),
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": PROMPTS, "echo": st.one_of(st.booleans(), json_values()),
                     "max_tokens": small_ints(0, 4),      # 0 with echo: the prompt alone (the scoring call)
                     "logprobs": small_ints(0, 5), "suffix": st.one_of(TEXTS, json_values())}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": MESSAGES, "logprobs": st.one_of(st.booleans(), json_values()),
               "top_logprobs": small_ints(0, 5), "max_completion_tokens": small_ints(1, 4),
               "add_generation_prompt": st.one_of(st.booleans(), json_values()),
               "tools": st.one_of(st.just([{"type": "function", "function": {"name": "f"}}]), json_values(),
                                  TEXTS.map(lambda d: [{"type": "function",
                                                        "function": {"name": "f", "description": d}}])),
               "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values()),
               "parallel_tool_calls": st.one_of(st.booleans(), json_values()),
               "echo": st.one_of(st.booleans(), json_values()),
               "continue_final_message": st.one_of(st.booleans(), json_values()),
               "chat_template": CHAT_TEMPLATES,
               "chat_template_kwargs": st.one_of(st.fixed_dictionaries({}, optional={
                   "enable_thinking": st.one_of(st.booleans(), TEXTS, json_values()),
                   "add_generation_prompt": json_values()}), json_values())}


# /v1/responses: input strings and items of every kind (messages with text and other parts, function calls and
# their outputs, unknown types), text formats, function and built-in tools, and the fields a stateless server refuses
_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]),
                                         "text": TEXTS}), max_size=2)
INPUT_ITEMS = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"]),
                           "content": st.one_of(TEXTS, _PARTS, json_values())},
                          optional={"type": st.sampled_from(["message", "reasoning", "item_reference"]),
                                    "status": st.sampled_from(["in_progress", "incomplete", "completed"])}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXTS, "name": TEXTS,
                           "arguments": st.one_of(st.just('{"city": "Paris"}'), TEXTS, json_values())}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXTS,
                           "output": st.one_of(TEXTS, _PARTS, json_values())}),
    json_values())
INPUTS = st.one_of(st.sampled_from(["Hi", "", "hi " * 700, []]), TEXTS, st.lists(INPUT_ITEMS, max_size=3),
                   json_values())
RESPONSE_TOOLS = st.one_of(st.just([{"type": "function", "name": "f"}]), st.just([{"type": "web_search"}]),
                           SCHEMAS.map(lambda s: [{"type": "function", "name": "f", "parameters": s}]),
                           TEXTS.map(lambda d: [{"type": "function", "name": "f", "description": d}]), json_values())
RESPONSES_FIELDS = {
    **{k: COMMON_FIELDS[k] for k in ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                     "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                                     "ignore_eos", "stream", "priority", "cache_salt", "user", "kv_transfer_params",
                                     "logit_bias", "include_stop_str_in_output", "skip_special_tokens",
                                     "structured_outputs")},
    "input": INPUTS, "instructions": st.one_of(TEXTS, json_values()), "max_output_tokens": small_ints(1, 4),
    "text": st.one_of(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {},
                                       {"format": None}]),
                      st.fixed_dictionaries({"format": st.fixed_dictionaries(
                          {"type": st.just("json_schema"), "name": st.just("x")},
                          optional={"schema": SCHEMAS, "strict": json_values()})}), json_values()),
    "tools": RESPONSE_TOOLS,
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"},
                                              {"type": "function", "name": "g"}, {"type": "web_search"}]),
                             json_values()),
    "include": st.one_of(st.just(["message.output_text.logprobs"]), st.lists(TEXTS, max_size=2), json_values()),
    "top_logprobs": small_ints(0, 21), "metadata": st.one_of(st.dictionaries(TEXTS, TEXTS, max_size=3),
                                                             json_values()),
    "store": st.one_of(st.booleans(), json_values()), "background": st.one_of(st.booleans(), json_values()),
    "previous_response_id": st.one_of(TEXTS, json_values()),
    "reasoning": st.one_of(st.just({"effort": "low"}), json_values()),
    "truncation": st.one_of(st.sampled_from(["auto", "disabled", "x"]), json_values()),
    "service_tier": st.one_of(st.sampled_from(["auto", "flex", "x"]), json_values()),
    "max_tool_calls": small_ints(0, 3), "parallel_tool_calls": st.one_of(st.booleans(), json_values()),
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
}


# /v1/messages: content strings and blocks of every kind (text, tool_use, tool_result, thinking, images, unknown),
# system strings and blocks, client and server tools, every tool_choice, thinking and output_config
_BLOCKS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXTS, json_values())}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "name": st.one_of(st.just("f"), TEXTS, json_values())},
                          optional={"id": st.one_of(TEXTS, json_values()),
                                    "input": st.one_of(st.just({"city": "Paris"}), json_values())}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.one_of(TEXTS, json_values())},
                          optional={"content": st.one_of(TEXTS, st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "image"]), "text": TEXTS}), max_size=2), json_values()),
                                    "is_error": json_values()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image", "document", "x"])},
                          optional={"thinking": TEXTS, "source": json_values()}),
    json_values())
ANTHROPIC_MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                    "content": st.one_of(TEXTS, st.lists(_BLOCKS, max_size=3), json_values())}),
             max_size=3),
    json_values())
ANTHROPIC_TOOLS = st.one_of(st.just([{"name": "f", "input_schema": {"type": "object"}}]),
                            SCHEMAS.map(lambda s: [{"name": "f", "description": "d", "input_schema": s}]),
                            st.just([{"type": "web_search_20250305", "name": "web_search"}]),
                            st.just([{"name": "", "input_schema": {}}]), json_values())
MESSAGES_FIELDS = {
    **{k: COMMON_FIELDS[k] for k in ("model", "temperature", "top_p", "top_k", "stream", "cache_salt",
                                     "kv_transfer_params")},
    "messages": ANTHROPIC_MESSAGES, "max_tokens": small_ints(1, 4),
    "system": st.one_of(TEXTS, st.lists(_BLOCKS, max_size=2), json_values()),
    "stop_sequences": STOPS, "tools": ANTHROPIC_TOOLS,
    "tool_choice": st.one_of(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                              {"type": "tool", "name": "f"}, {"type": "tool", "name": "g"},
                                              {"type": "tool"}, {"type": "any", "disable_parallel_tool_use": True}]),
                             json_values()),
    "metadata": st.one_of(st.fixed_dictionaries({}, optional={"user_id": st.one_of(TEXTS, json_values())}),
                          json_values()),
    "thinking": st.one_of(st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                           {"type": "adaptive"}, {"type": "enabled"}]), json_values()),
    "output_config": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.just("json_schema")}, optional={"schema": SCHEMAS})}), json_values()),
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
}


def _optional(fields: dict, keys: list[str]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={k: fields[k] for k in keys})


@st.composite
def bodies(draw, kind: str, model: str) -> dict:
    """A body of ``/v1/completions`` (kind "completion"), ``/v1/chat/completions`` ("chat") or ``/v1/responses``
    ("responses"): a cheap valid one with a few fields replaced, removed or added."""
    if kind == "responses":
        return draw(_responses_body(model))
    if kind == "messages":
        return draw(_messages_body(model))
    fields = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    body = {"model": model, "max_tokens": 2}
    body.update({"prompt": "Hello"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]})
    keys = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    body.update(draw(_optional(fields, keys)))
    # Never drop max_tokens from a chat body: the node would fill the context, hundreds of tokens on a CPU.
    removable = ["model", "prompt" if kind == "completion" else "messages"] + (["max_tokens"] if kind == "completion"
                                                                              else [])
    for key in draw(st.lists(st.sampled_from(removable), max_size=2, unique=True)):
        body.pop(key, None)
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in fields),
                                     json_values(), max_size=2)))
    return body


@st.composite
def _responses_body(draw, model: str) -> dict:
    body = {"model": model, "max_output_tokens": 2, "input": "Hi"}
    keys = draw(st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=4, unique=True))
    body.update(draw(_optional(RESPONSES_FIELDS, keys)))
    for key in draw(st.lists(st.sampled_from(["model", "input"]), max_size=2, unique=True)):
        body.pop(key, None)   # never max_output_tokens: the rest of the context is hundreds of tokens on a CPU
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in RESPONSES_FIELDS),
                                     json_values(), max_size=2)))
    return body


@st.composite
def _messages_body(draw, model: str) -> dict:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    keys = draw(st.lists(st.sampled_from(sorted(MESSAGES_FIELDS)), max_size=4, unique=True))
    body.update(draw(_optional(MESSAGES_FIELDS, keys)))
    for key in draw(st.lists(st.sampled_from(["model", "messages", "max_tokens"]), max_size=2, unique=True)):
        body.pop(key, None)   # max_tokens is required here: without it, a 400
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in MESSAGES_FIELDS),
                                     json_values(), max_size=2)))
    return body


def _dumps(body: dict) -> bytes:
    return json.dumps(body).encode()  # NaN and inf go out as NaN/Infinity literals: the server must refuse them


@st.composite
def raw_bodies(draw, model: str) -> tuple[bytes, str]:
    """(bytes, label): a body that is not a well-formed JSON object of sane size."""
    valid = _dumps({"model": model, "prompt": "Hello", "max_tokens": 2})
    choice = draw(st.sampled_from(["truncated", "deep", "deep_object", "literal", "utf8", "empty", "not_object",
                                   "huge_prompt", "huge_tokens", "bom", "duplicate_keys", "garbage"]))
    if choice == "truncated":
        return valid[:draw(st.integers(1, len(valid) - 1))], choice
    if choice in ("deep", "deep_object"):
        depth = draw(st.sampled_from([33, 100, 999, 1000, 3000, 50_000]))
        opener, closer = ("[", "]") if choice == "deep" else ('{"a": ', "}")
        where = draw(st.sampled_from(["prompt", "temperature", "kv_transfer_params", "extra"]))
        nested = opener * depth + "1" + closer * depth
        return f'{{"model": "{model}", "max_tokens": 2, "prompt": "x", "{where}": {nested}}}'.encode(), choice
    if choice == "literal":
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "1" * 5000, "0x10",
                                        "+1", ".5", "01"]))
        where = draw(st.sampled_from(["temperature", "max_tokens", "seed", "top_p", "extra"]))
        return f'{{"model": "{model}", "prompt": "x", "max_tokens": 2, "{where}": {literal}}}'.encode(), choice
    if choice == "utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xc0\xaf"]))
        at = valid.index(b"Hello") + draw(st.integers(0, 5))
        return valid[:at] + bad + valid[at:], choice
    if choice == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"null"])), choice
    if choice == "not_object":
        return draw(st.sampled_from([b"[]", b"[1, 2]", b'"text"', b"123", b"true", b"[{}]"])), choice
    if choice == "huge_prompt":  # beyond max_model_len once tokenized: a 400 after the tokenizer's work
        return _dumps({"model": model, "max_tokens": 2, "prompt": "lorem ipsum " * draw(st.integers(300, 3000))}), \
            choice
    if choice == "huge_tokens":
        return _dumps({"model": model, "max_tokens": 2, "prompt": [7] * draw(st.integers(600, 20_000))}), choice
    if choice == "bom":
        return b"\xef\xbb\xbf" + valid, choice
    if choice == "duplicate_keys":  # JSON allows them; the last wins, as in Python
        return f'{{"model": "{model}", "prompt": "x", "max_tokens": 99999, "max_tokens": 2}}'.encode(), choice
    return draw(st.binary(max_size=64)), choice


CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "application/json",
                                 "application/json; charset=utf-8", None, "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/vnd.api+json", "garbage"])


@st.composite
def fuzz_cases(draw, model: str, api_key: str | None = None) -> FuzzCase:
    """One exchange with the server (see the module docstring)."""
    headers = {}
    if api_key:
        auth = draw(st.sampled_from(["good"] * 8 + ["missing", "wrong", "x-api-key"]))
        if auth == "good":
            headers["Authorization"] = f"Bearer {api_key}"
        elif auth == "wrong":
            headers["Authorization"] = "Bearer nope"
        elif auth == "x-api-key":
            headers["x-api-key"] = api_key
    kind = draw(st.sampled_from(["completion"] * 4 + ["chat"] * 4 + ["responses"] * 3 + ["messages"] * 3
                                + ["raw"] * 3 + ["method", "path", "vanish"]))
    path = draw(st.sampled_from(ENDPOINTS))
    if kind in ("completion", "chat", "responses", "messages"):
        path = {"responses": RESPONSES, "messages": MESSAGES_PATH}.get(kind) or ENDPOINTS[kind == "chat"]
        content, label = _dumps(draw(bodies(kind, model))), kind
    elif kind == "raw":
        content, label = draw(raw_bodies(model))
        label = "raw:" + label
    elif kind == "method":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        return FuzzCase(method, path, b"", headers, label="method")
    elif kind == "path":
        bad_path = draw(st.sampled_from(["/v1/complet", "/v1/completions/x", "/v2/completions", "/v1/chat",
                                         "/v1/completions%00", "/v1//completions", "/" + "a" * 2000]))
        return FuzzCase("POST", bad_path, _dumps({"model": model, "prompt": "x"}),
                        {**headers, "Content-Type": "application/json"}, label="path")
    else:
        stream = draw(st.booleans())
        path = draw(st.sampled_from((*ENDPOINTS, RESPONSES, MESSAGES_PATH)))
        body = {"model": model, "max_tokens": 32, "ignore_eos": True, "stream": stream}
        if path == RESPONSES:
            body = {"model": model, "max_output_tokens": 32, "ignore_eos": True, "stream": stream,
                    "input": "Tell a story"}
        body.update({"prompt": "Once upon a time"} if path == ENDPOINTS[0] else
                    {"messages": [{"role": "user", "content": "Tell a story"}]} if path in (ENDPOINTS[1], MESSAGES_PATH)
                    else {})
        if path == MESSAGES_PATH:   # its max_tokens alone: its body passes no ignore_eos on (32 tokens or fewer)
            body.pop("ignore_eos")
        if draw(st.booleans()) and path in ENDPOINTS:
            body["n"] = 2
        return FuzzCase("POST", path, _dumps(body), {**headers, "Content-Type": "application/json"},
                        vanish="after_first_bytes" if stream else "before_answer", label="vanish")
    content_type = draw(CONTENT_TYPES)
    if content_type is not None:
        headers["Content-Type"] = content_type
    return FuzzCase("POST", path, content, headers, label=label)


def valid_completion(model: str, api_key: str | None, max_tokens: int = 2) -> FuzzCase:
    """A request that must come back 200 with exactly ``max_tokens`` completion tokens."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0.7,
            "ignore_eos": True}
    return FuzzCase("POST", ENDPOINTS[0], _dumps(body), headers, label="valid")


# ---- sending and checking ---------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    headers: dict
    body: bytes


async def send(client: httpx.AsyncClient, case: FuzzCase) -> Answer | None:
    """Perform ``case`` (None for a client that vanished on purpose)."""
    if case.vanish is not None:
        await _vanish(str(client.base_url), case)
        return None
    r = await client.request(case.method, case.path, content=case.content, headers=case.headers)
    return Answer(r.status_code, dict(r.headers), r.content)


async def _vanish(base_url: str, case: FuzzCase) -> None:
    """Send the request on a raw socket and close it: after the first bytes of the answer, or at once."""
    url = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = [f"{case.method} {case.path} HTTP/1.1", f"Host: {url.hostname}:{url.port}",
            f"Content-Length: {len(case.content)}"] + [f"{k}: {v}" for k, v in case.headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + case.content)
    await writer.drain()
    if case.vanish == "after_first_bytes":
        try:
            await asyncio.wait_for(reader.read(64), timeout=60)
        except asyncio.TimeoutError:
            pass
    writer.transport.abort()  # a reset, as a killed client leaves it


def check_answer(case: FuzzCase, answer: Answer | None) -> None:
    """What every answer must satisfy, valid request or not."""
    if answer is None:
        return
    assert answer.status < 500, f"{answer.status} for {case!r}: {answer.body[:500]!r}"
    if case.path.startswith(MESSAGES_PATH):
        _check_message(case, answer)
        return
    if answer.status >= 400:
        try:
            error = json.loads(answer.body)["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"{answer.status} without an OpenAI error object for {case!r}: "
                                 f"{answer.body[:300]!r}") from None
        assert set(error) == {"message", "type", "param", "code"}, (case, error)
        assert isinstance(error["message"], str) and error["message"], (case, error)
        return
    assert answer.status == 200, (case, answer.status)
    if case.path == RESPONSES:
        _check_response(case, answer)
    elif answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in answer.body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (case, answer.body[-300:])
        for event in events[:-1]:
            assert "error" not in json.loads(event), (case, event)
    else:
        assert "choices" in json.loads(answer.body), (case, answer.body[:300])


def _check_response(case: FuzzCase, answer: Answer) -> None:
    """A 200 of /v1/responses: a Response, or its events in order, numbered, ending with response.completed."""
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        assert json.loads(answer.body)["object"] == "response", (case, answer.body[:300])
        return
    events = [json.loads(line[6:]) for line in answer.body.decode().split("\n") if line.startswith("data: ")]
    assert events and [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"], \
        (case, answer.body[:300])
    assert events[-1]["type"] == "response.completed", (case, answer.body[-300:])
    assert [e["sequence_number"] for e in events] == list(range(len(events))), (case, answer.body[:300])
    assert not any(e["type"] == "error" for e in events), (case, answer.body[-300:])


def _check_message(case: FuzzCase, answer: Answer) -> None:
    """An answer of /v1/messages: an Anthropic error; or a Message, or its events from message_start to
    message_stop with no error event."""
    if answer.status >= 400:
        body = json.loads(answer.body)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (case, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], (case, body)
        return
    assert answer.status == 200, (case, answer.status)
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        assert json.loads(answer.body)["type"] == "message", (case, answer.body[:300])
        return
    events = [json.loads(line[6:]) for line in answer.body.decode().split("\n") if line.startswith("data: ")]
    assert events and events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", \
        (case, answer.body[-300:])
    assert not any(e["type"] == "error" for e in events), (case, answer.body[-300:])
