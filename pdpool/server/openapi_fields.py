"""The building blocks of ``pdpool.server.openapi``'s request bodies: JSON Schema for typed and bounded values,
the rules across fields that JSON Schema can say, and the field groups several endpoints share (sampling,
structured output, the common request fields, chat messages, request chat templates). Each group says what the
parser it names accepts (``pdpool.server.protocol``, ``SamplingParams.validate``)."""

from __future__ import annotations

from pdpool.engine.sampling_params import _FLOAT32_MAX, LOGIT_BIAS_MAX, MAX_LOGIT_BIAS_ENTRIES, SEED_MAX, SEED_MIN
from pdpool.server.protocol import MAX_LOGPROBS, MAX_N


def nullable(schema: dict) -> dict:
    """``schema`` or null (``{"type": [T, "null"]}`` where one type is named)."""
    if not isinstance(schema.get("type"), str):
        return {"anyOf": [schema, {"type": "null"}]}
    out = {**schema, "type": [schema["type"], "null"]}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def integer(low: int | None = None, high: int | None = None) -> dict:
    s: dict = {"type": "integer"}
    if low is not None:
        s["minimum"] = low
    if high is not None:
        s["maximum"] = high
    return s


def number(low: float | None, high: float | None, *, low_open: bool = False) -> dict:
    s: dict = {"type": "number"}
    if low is not None:
        s["exclusiveMinimum" if low_open else "minimum"] = low
    s["maximum"] = _FLOAT32_MAX if high is None else high
    return s


def token_id(vocab_size: int | None) -> dict:
    return integer(0, None if vocab_size is None else vocab_size - 1)


def token_id_key(vocab_size: int | None) -> str:
    """A regex for ``logit_bias``' keys as the parser takes them (``[+-]?[0-9]{1,19}``, an int in the vocabulary
    where its size is known: a sign and leading zeros allowed, 19 digits at most)."""
    if vocab_size is None:
        return r"^[+-]?[0-9]{1,19}$"
    return rf"^(?:\+?(?:{'|'.join(_decimal_below(vocab_size, 19))})|-0{{1,19}})$"


def _decimal_below(n: int, digits: int) -> list[str]:
    """Regexes for the integers in [0, n) written in at most ``digits`` digits (leading zeros allowed).

    For n - 1 = 49151: 0{1,19} | 0{0,18}[1-9] | ... | 0{0,14}[1-3][0-9]{4} | 0{0,14}4[0-8][0-9]{3} | ... | 0{0,14}4915[0-1]
    """
    top = str(n - 1)
    alternatives = [f"0{{1,{digits}}}"]
    for length in range(1, len(top)):          # fewer digits than top
        alternatives.append(f"0{{0,{digits - length}}}[1-9]" + "[0-9]" * (length - 1))
    zeros = f"0{{0,{digits - len(top)}}}"
    for i, digit in enumerate(top):            # top's first i digits, then a smaller digit (top's own, last)
        low, high = (1 if i == 0 else 0), (int(digit) if i == len(top) - 1 else int(digit) - 1)
        if high >= low:
            alternatives.append(f"{zeros}{top[:i]}[{low}-{high}]" + "[0-9]" * (len(top) - 1 - i))
    return alternatives


def needs(field: str, when: dict, other: str, value) -> dict:
    """The rule "``field`` matching ``when`` needs ``other`` set to ``value``" (if/then: schemathesis draws these
    far faster than dependentSchemas with anyOf)."""
    return {"if": {"required": [field], "properties": {field: when}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


SET = {"not": {"type": "null"}}
STREAM_RULE = needs("stream_options", SET, "stream", True)                         # protocol._stream_options
CONTINUE_RULE = needs("continue_final_message", {"const": True}, "add_generation_prompt", False)  # its default: true


def sampling_fields(vocab_size: int | None, max_model_len: int | None) -> dict:
    """The sampling fields both endpoints share (``protocol._sampling_fields``, ``SamplingParams.validate``)."""
    token = token_id(vocab_size)
    word = {"type": "string", "minLength": 1}
    return {
        "temperature": nullable(number(0, 2)),
        "top_p": nullable(number(0, 1, low_open=True)),
        "top_k": nullable({**integer(-1), "description": "-1 or 0: no top-k"}),
        "min_p": nullable(number(0, 1)),
        "presence_penalty": nullable(number(-2, 2)),
        "frequency_penalty": nullable(number(-2, 2)),
        "repetition_penalty": nullable(number(0, None, low_open=True)),
        "seed": nullable({**integer(SEED_MIN, SEED_MAX), "description": "with n > 1, choice j is seeded seed + j, so "
                                                                      "seed + n - 1 must stay in range"}),
        "stop": nullable({"anyOf": [word, {"type": "array", "items": word}]}),
        "stop_token_ids": nullable({"type": "array", "items": token}),
        "ignore_eos": nullable({"type": "boolean"}),
        "min_tokens": nullable({**integer(0), "description": "at most max_tokens"}),
        "include_stop_str_in_output": nullable({"type": "boolean"}),
        "skip_special_tokens": nullable({"type": "boolean"}),
        "logit_bias": nullable({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": token_id_key(vocab_size)},
            "additionalProperties": {"type": "number", "description": f"clamped to [-{LOGIT_BIAS_MAX:g}, "
                                                                      f"{LOGIT_BIAS_MAX:g}]"},
            "description": "token id (a decimal string in the vocabulary) -> bias"}),
        "truncate_prompt_tokens": nullable({"anyOf": [{"const": -1}, integer(1, max_model_len)],
                                             "description": "keep the prompt's last N tokens (-1: the context)"}),
        "allowed_token_ids": nullable({"type": "array", "items": token, "minItems": 1}),
        "bad_words": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": word}],
                                "description": "words never generated (one string: one word; \"\": none)"}),
        **structured_fields(),
    }


def structured_fields() -> dict:
    """Structured output (``protocol._structured``): at most one of these constrains the output, and a schema,
    regex or grammar must compile (llguidance's dialects), which JSON Schema cannot say."""
    text = {"type": "string", "minLength": 1}
    schema = {"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "a JSON schema"}
    choices = {"type": "array", "items": text, "minItems": 1}
    tag = {"type": "object", "required": ["structures", "triggers"], "properties": {
        "structures": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["begin", "schema", "end"],
            "properties": {"begin": {"type": "string"}, "schema": schema, "end": {"type": "string"}}}},
        "triggers": {"type": "array", "items": text}},
        "description": "vLLM's structural tag: each begin starts with one of the triggers (xgrammar's 'format' shape "
                       "is refused)"}
    kinds = {"json": {"anyOf": [schema, {"type": "string", "description": "a JSON schema as text"}]},
             "regex": text, "choice": choices, "grammar": {**text, "description": "Lark or GBNF"},
             "json_object": {"type": "boolean"},
             "structural_tag": {"anyOf": [tag, {"type": "string", "description": "the structural tag as JSON text"}]}}
    return {
        "response_format": nullable({"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": nullable({"type": "string"}), "description": nullable({"type": "string"}),
                    "schema": schema, "strict": nullable({"type": "boolean"})}}}},
            {**tag, "required": ["type", *tag["required"]],
             "properties": {"type": {"const": "structural_tag"}, **tag["properties"]}}]}),
        "structured_outputs": nullable({
            "type": "object", "additionalProperties": False,
            "properties": {**{k: nullable(v) for k, v in kinds.items()},
                           "disable_any_whitespace": {"type": "boolean"}, "disable_fallback": {"type": "boolean"},
                           "disable_additional_properties": {"type": "boolean"},
                           "whitespace_pattern": nullable({"type": "string"})},
            "oneOf": [{"required": [k], "properties": {k: {"const": True} if k == "json_object" else SET}}
                      for k in kinds],
            "description": "vLLM's: exactly one of json, regex, choice, grammar, structural_tag (not null) and "
                           "json_object (true)"}),
        "guided_json": nullable(kinds["json"]), "guided_regex": nullable(text),
        "guided_choice": nullable(choices), "guided_grammar": nullable(kinds["grammar"]),
    }


def common_fields(model: dict) -> dict:
    """``protocol._common``'s fields (the ones a client sends; refusals of unimplemented features are omitted)."""
    return {
        "model": nullable(model),
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable({"type": "object", "properties": {
            "include_usage": nullable({"type": "boolean"}),
            "continuous_usage_stats": nullable({"type": "boolean"})}}),
        "n": nullable(integer(1, MAX_N)),
        "prompt_logprobs": nullable(integer(0, MAX_LOGPROBS)),
        "priority": nullable(integer(SEED_MIN, SEED_MAX)),
        "cache_salt": nullable({"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[^@/\\\\\\u0000]*$"}),
        "user": nullable({"type": "string"}),
        "return_token_ids": nullable({"type": "boolean"}),
        "return_tokens_as_token_ids": nullable({"type": "boolean", "description": (
            "logprobs name tokens 'token_id:<id>' (null: the server's --return-tokens-as-token-ids)")}),
        "use_beam_search": nullable({"type": "boolean", "description": (
            "vLLM's beam search, n beams wide (n at most 10): the choices are the n best beams. Not with a "
            "streamed completion, logprobs, echo, prompt_logprobs, a constraint, stop, min_tokens, penalties, "
            "top_p/top_k/min_p, logit_bias, allowed_token_ids or bad_words")}),
        "length_penalty": nullable({"type": "number", "description": (
            "beam search: a beam's score is its log probability over its length to this power")}),
    }


def chat_messages() -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["function"], "properties": {   # protocol._history_tool_calls
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    properties = {"role": {"type": "string"}, "content": content,
                  "tool_calls": nullable({"type": "array", "items": call}),
                  "tool_call_id": nullable({"type": "string"}), "name": nullable({"type": "string"})}
    message = {"type": "object", "required": ["role"], "properties": properties}
    # content null: an assistant's alone (protocol._messages)
    assistant = {**message, "properties": {**properties, "role": {"const": "assistant"}, "content": nullable(content)}}
    return {"type": "array", "items": {"anyOf": [message, assistant]}, "minItems": 1}


def chat_template_field(trusted: bool) -> dict:
    """A request's ``chat_template``: with --trust-request-chat-template a jinja template (one that does not
    render is a 400 naming it); without, only null."""
    if trusted:
        return nullable({"type": "string", "description": "a jinja chat template in place of the model's (\"\": "
                                                           "the model's); one that fails to render is a 400"})
    return {"type": "null", "description": "a request's template needs --trust-request-chat-template"}


def template_kwargs_field(trusted: bool) -> dict:
    """``chat_template_kwargs``: ``tokenize`` refused; ``chat_template`` a request template (trusted only)."""
    if trusted:
        return nullable({"type": "object", "not": {"required": ["tokenize"]},
                          "properties": {"chat_template": nullable({"type": "string"})},
                          "description": "more variables for the chat template (enable_thinking, say): those it "
                                         "reads are passed; chat_template is the request's template (vLLM's older "
                                         "way), tokenize is refused"})
    return nullable({"type": "object", "not": {"required": ["tokenize"]},
                      "properties": {"chat_template": {"type": "null"}},
                      "description": "more variables for the chat template (enable_thinking, say): those it reads "
                                     "are passed; tokenize, and a chat_template (it needs "
                                     "--trust-request-chat-template), are refused"})
