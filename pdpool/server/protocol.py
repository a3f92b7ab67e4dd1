"""OpenAI request bodies -> validated ``GenerationRequest``s (prompts + ``SamplingParams``).

Every check raises ``APIError`` (400) naming the offending ``param``; nothing here touches the engine
beyond ``SamplingParams.validate()`` (which also parses ``logit_bias``: see ``pdpool.engine.sampling_params``).
Fields beyond OpenAI's (``priority``, ``cache_salt``, ``top_k``, ...) follow vLLM's names. ``kv_transfer_params``
is kept as given, for the disaggregation work, except that a request to a prefill node (``do_remote_decode``)
must be one plain choice: no stream, ``n`` 1, one prompt.

The bodies come from ``pdpool.server.json_body`` (bytes to a JSON object, the one strict reader of every route).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pdpool.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, SamplingParamsError, short_repr
from pdpool.engine.structured import StructuredOutputs
from pdpool.frontend import DEFAULTABLE, InvalidRequestError, message_text
from pdpool.server.errors import APIError
from pdpool.server.tools import ToolChoice, parse_tools

MAX_LOGPROBS = 20
MAX_N = 16
INT64_MIN, INT64_MAX = SEED_MIN, SEED_MAX

Prompt = str | list[int]


@dataclass
class GenerationRequest:
    kind: str                       # "completion" | "chat"
    model: str
    prompts: list[Prompt]           # one per choice group; chat: one rendered prompt string
    params: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    echo: bool = False
    logprobs: int | None = None     # completions: top-N; chat: top_logprobs when logprobs=true
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: choices carry token_ids, the response prompt_token_ids
    echo_only: bool = False         # completions' echo with max_tokens 0: the prompt back, nothing generated
    prompt_logprobs: int | None = None  # vLLM's field: the answer carries the prompt's logprobs in vLLM's format
    # pdpool's extension (``pdpool_prompt_token_ids``): the token ids of each prompt, computed by the router with
    # the same front end, so router and engine hash the same tokens; the node does not tokenize again.
    prompt_token_ids: list[list[int]] | None = None
    # chat's tool_choice "required" or a named function: the answer's text is read back as tool calls
    tool_choice: ToolChoice | None = None
    # vLLM's: logprobs name tokens ``token_id:<id>``; None: the server's default (``--return-tokens-as-token-ids``)
    return_tokens_as_token_ids: bool | None = None
    # chat: the answer's role, vLLM's: the assistant's, or with add_generation_prompt false the last message's
    response_role: str = "assistant"
    # chat's echo (vLLM's): the text each choice's content starts with, the last message's when its role is the
    # answer's; "" is none
    chat_echo: str = ""
    # vLLM's beam search (``pdpool.server.beam_search``): the n choices are the n best beams; length_penalty
    # divides a beam's log probability by its length to that power
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # the JSON body it was parsed from: the generation defaults fill only the fields it left unset (read then, not
    # at every parse: the router parses every request and applies no defaults)
    body: dict | None = dataclasses.field(default=None, repr=False, compare=False)


# ---- typed field readers -------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: int | None = None, *, ge: int | None = None,
            le: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise APIError(f"'{name}' must be an integer, got {short_repr(v)}", param=name)
    if ge is not None and v < ge:
        raise APIError(f"'{name}' must be >= {ge}, got {short_repr(v)}", param=name)
    if le is not None and v > le:
        raise APIError(f"'{name}' must be <= {le}, got {short_repr(v)}", param=name)
    return v


def get_float(body: dict, name: str, default: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(f"'{name}' must be a number, got {short_repr(v)}", param=name)
    try:
        return float(v)
    except OverflowError:  # an int beyond float's range
        raise APIError(f"'{name}' must be a finite number, got {short_repr(v)}", param=name) from None


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"'{name}' must be a boolean, got {short_repr(v)}", param=name)
    return v


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise APIError(f"'{name}' must be a string, got {short_repr(v)}", param=name)
    return _text(v, name)


def _text(s: str, name: str) -> str:
    """``s`` if it is encodable text: JSON's ``\\ud800`` escapes can smuggle in unpaired surrogates, which no
    tokenizer or UTF-8 response can take."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"'{name}' contains an unpaired UTF-16 surrogate escape", param=name) from None
    return s


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    if any(s == "" for s in v):
        raise APIError("'stop' strings must not be empty", param="stop")
    return [_text(s, "stop") for s in v]


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise APIError(f"'{name}' must be a list of integers", param=name)
    return v


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return get_bool(opts, "include_usage"), get_bool(opts, "continuous_usage_stats")


PRIORITY_HEADER = "X-Vllm-Priority"


def header_priority(header: str | None, priority: int) -> int:
    """vLLM's ``X-Vllm-Priority``: a request header that, an integer, wins over the body's ``priority``; a header
    that is not one is ignored, as vLLM ignores it."""
    try:
        return int(header) if header is not None else priority
    except ValueError:
        return priority


def model_not_found(model: str, served_model_names: list[str]) -> APIError:
    """The 404 for a model name this server does not serve (a request's ``model``, or ``GET /v1/models/{model}``)."""
    return APIError(f"The model {short_repr(model)} does not exist. Served: {served_model_names}", status=404,
                    param="model", code="model_not_found")


def _common(body: dict, kind: str, served_model_names: list[str]) -> dict:
    """The fields every generation request shares. ``model``, any served name, becomes the first, which the answer
    carries (vLLM's, with several ``--served-model-name``)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    if model and model not in served_model_names:   # "", as null, is the served model (vLLM's rule)
        raise model_not_found(model, served_model_names)
    model = served_model_names[0]
    stream = get_bool(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    n = get_int(body, "n", 1, ge=1, le=MAX_N)
    best_of = get_int(body, "best_of", None, ge=1)
    if best_of is not None and best_of != n:
        raise APIError("'best_of' other than 'n' is not supported", param="best_of")
    if not _REFUSAL_FIELDS.isdisjoint(body):   # most bodies have none of them: no per-field reads
        _refuse_constrained(body, kind)
        _refuse_unimplemented(body, kind)
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise APIError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    return dict(kind=kind, model=model, stream=stream, include_usage=include_usage, continuous_usage=continuous,
                prompt_logprobs=get_int(body, "prompt_logprobs", None, ge=0, le=MAX_LOGPROBS)
                if "prompt_logprobs" in body else None,
                n=n, priority=get_int(body, "priority", 0, ge=INT64_MIN, le=INT64_MAX),
                cache_salt=_cache_salt(body),
                kv_transfer_params=kv, user=get_str(body, "user"),
                return_token_ids=get_bool(body, "return_token_ids"),
                return_tokens_as_token_ids=get_bool(body, "return_tokens_as_token_ids", None),
                use_beam_search=get_bool(body, "use_beam_search"),
                length_penalty=get_float(body, "length_penalty", 1.0))


_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_CACHE_SALT = 128


def _cache_salt(body: dict) -> str | None:
    """vLLM's rule (0.32): a salt is a non-empty string of at most 128 characters without '@', '/', '\\' or NUL."""
    salt = get_str(body, "cache_salt")
    if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT or not _SALT_FORBIDDEN.isdisjoint(salt)):
        raise APIError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} characters without "
                       f"'@', '/', '\\' or NUL, got {short_repr(salt)}", param="cache_salt")
    return salt


# vLLM's older structured-output fields, each one constraint of ``structured_outputs``.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def _structured(body: dict) -> StructuredOutputs | None:
    """The output's constraint, from OpenAI's ``response_format`` (``json_object``, ``json_schema``, vLLM's
    ``structural_tag``; ``text`` is none), vLLM's ``structured_outputs`` or its older ``guided_*`` fields: at most
    one of them may constrain."""
    found = []
    try:
        fmt = body.get("response_format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                found.append(StructuredOutputs("json_object", True, param="response_format"))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or spec.get("schema") is None:
                    raise APIError("'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
                                   "\"schema\": {...}}", param="response_format")
                for key, kind in (("name", str), ("description", str), ("strict", bool)):
                    if spec.get(key) is not None and not isinstance(spec[key], kind):
                        raise APIError(f"'response_format.json_schema.{key}' must be a "
                                       f"{'string' if kind is str else 'boolean'}, got {short_repr(spec[key])}",
                                       param="response_format")
                found.append(StructuredOutputs.parse({"json": spec["schema"]}, "response_format"))
            elif kind == "structural_tag":   # vLLM's: {"type", "structures", "triggers"} (or xgrammar's "format")
                found.append(StructuredOutputs.parse({"structural_tag": {k: v for k, v in fmt.items() if k != "type"}},
                                                     "response_format"))
            elif kind != "text":
                raise APIError(f"'response_format' must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}}, "
                               f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}} or {{\"type\": "
                               f"\"structural_tag\", \"structures\": [...], \"triggers\": [...]}}, got {short_repr(fmt)}",
                               param="response_format")
        if body.get("structured_outputs") is not None:
            found.append(StructuredOutputs.parse(body["structured_outputs"], "structured_outputs"))
        for name, kind in _GUIDED.items():
            if body.get(name) is not None:
                found.append(StructuredOutputs.parse({kind: body[name]}, name))
    except SamplingParamsError as exc:
        raise APIError(str(exc), param=exc.param) from None
    if len(found) > 1:
        raise APIError(f"only one of {', '.join(_STRUCTURED_FIELDS)} may constrain the output, got "
                       f"{', '.join(s.param for s in found)}", param=found[1].param)
    return found[0] if found else None


def _refuse_constrained(body: dict, kind: str) -> None:
    """Features a client would rely on without noticing that they were dropped (the legacy ``functions``, tools
    on completions) are a 400, not a silent answer in plain text. A list with ``"none"`` asks for text: accepted.
    Chat's ``tools`` are ``pdpool.server.tools``' (read by ``parse_chat``)."""
    pairs = (("functions", "function_call"),) if kind == "chat" else (("tools", "tool_choice"),
                                                                       ("functions", "function_call"))
    for listed, choice in pairs:
        if body.get(listed) and body.get(choice, "auto") != "none":
            raise APIError(f"tool calling is not supported: send '{choice}': \"none\" to have '{listed}' "
                           f"ignored and get text", param=listed)
        # without tools too: "required" or a named function demands a call that plain text would not be
        if body.get(choice) not in (None, "none", "auto"):
            raise APIError(f"'{choice}' {short_repr(body.get(choice))} asks for a tool call, and tool calling is "
                           f"not supported (only \"none\" and \"auto\" are taken, for a text answer)", param=choice)


# vLLM's request fields that pdpool does not implement. Unknown fields are ignored, as in vLLM, but these vLLM
# knows: dropped, each would answer another request than the one sent, so any value but absent (null) or a no-op
# one is a 400.
_UNIMPLEMENTED = ("logits_processors",)


def _refuse_unimplemented(body: dict, kind: str) -> None:
    for name in _UNIMPLEMENTED:
        value = body.get(name)
        if value is not None and value is not False and not (isinstance(value, list) and not value):  # no-ops
            raise APIError(f"'{name}' is not supported (got {short_repr(value)})", param=name)


# Every field the two functions above read.
_TOOL_FIELDS = frozenset(("tools", "tool_choice", "parallel_tool_calls"))
_REFUSAL_FIELDS = frozenset(("tools", "tool_choice", "functions", "function_call", *_UNIMPLEMENTED))


# The body fields ``_sampling_fields`` reads; a body with none of them gets ``SamplingParams``' defaults.
_SAMPLING_FIELDS = frozenset(("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                              "include_stop_str_in_output", "skip_special_tokens", "logit_bias",
                              "truncate_prompt_tokens", "allowed_token_ids", "bad_words", *_STRUCTURED_FIELDS))


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if _SAMPLING_FIELDS.isdisjoint(body):
        # What reading each absent field below gives (its default, the same as SamplingParams'), without 14
        # reads: a test compares the two on arbitrary bodies.
        try:
            return SamplingParams.defaults(max_tokens, logprobs)
        except SamplingParamsError as exc:
            raise APIError(str(exc), param=exc.param) from None
    return _sampling_fields(body, max_tokens, logprobs)


def _sampling_fields(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop_token_ids = body.get("stop_token_ids")
    kwargs = dict(
        temperature=get_float(body, "temperature", 1.0),
        top_p=get_float(body, "top_p", 1.0),
        top_k=get_int(body, "top_k", 0),
        min_p=get_float(body, "min_p", 0.0),
        presence_penalty=get_float(body, "presence_penalty", 0.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0),
        repetition_penalty=get_float(body, "repetition_penalty", 1.0),
        seed=get_int(body, "seed"),
        stop=_stop(body),
        stop_token_ids=_int_list(stop_token_ids, "stop_token_ids") if stop_token_ids is not None else [],
        ignore_eos=get_bool(body, "ignore_eos"),
        max_tokens=max_tokens,
        min_tokens=get_int(body, "min_tokens", 0),
        logprobs=logprobs,
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        # token id -> bias; SamplingParams parses the keys and clamps the values to [-100, 100] as vLLM does (its
        # errors name logit_bias); the ids are checked against the vocabulary where it is known (router, engine)
        logit_bias=body.get("logit_bias"),
        truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens"),   # -1 or >= 1: SamplingParams checks
        allowed_token_ids=_allowed_token_ids(body),
        bad_words=_bad_words(body),
        structured_outputs=_structured(body),
    )
    return make_sampling_params(kwargs)


def apply_generation_defaults(req: GenerationRequest, defaults, max_model_len: int) -> None:
    """A node's generation defaults (``pdpool.frontend.GenerationDefaults``) on the fields ``req`` left unset, as
    vLLM (0.32) applies its generation config: each sampling field the body did not set (or set to null); a chat's
    budget when it gave none (within the context); a cap on every budget. A beam search takes only the
    temperature, as vLLM's. A request the defaults make inconsistent (``min_tokens`` over the cap) is a 400."""
    params, body = req.params, req.body or {}
    for name, value in defaults.sampling.items():
        if body.get(name) is None and (name == "temperature" or not req.use_beam_search):
            setattr(params, name, value)
    if req.kind == "chat" and not req.max_tokens_given and defaults.max_tokens is not None:
        params.max_tokens = min(defaults.max_tokens, max_model_len)
    if defaults.max_tokens_cap is not None and not req.echo_only:
        params.max_tokens = min(params.max_tokens or max_model_len, defaults.max_tokens_cap)
    try:
        params.validate()
    except SamplingParamsError as exc:
        raise APIError(f"{exc} (with the server's generation defaults)", param=exc.param) from None


def _bad_words(body: dict) -> list[str] | str | None:
    """vLLM's ``bad_words``: null, a list of strings (SamplingParams checks each; [] is none) or one string."""
    value = body.get("bad_words")
    if value is not None and not isinstance(value, (list, str)):
        raise APIError(f"'bad_words' must be a list of strings, got {short_repr(value)}", param="bad_words")
    for word in [value] if isinstance(value, str) else value or ():
        if isinstance(word, str):   # the rest SamplingParams refuses by type
            _text(word, "bad_words")
    return value or None


def _allowed_token_ids(body: dict) -> list[int] | None:
    """vLLM's ``allowed_token_ids``: null, or a non-empty list of token ids (checked against the vocabulary where
    it is known); an empty list is a 400, as in vLLM."""
    value = body.get("allowed_token_ids")
    if value is None:
        return None
    ids = _int_list(value, "allowed_token_ids")
    if not ids:
        raise APIError("'allowed_token_ids' must hold at least one token id (or be null)", param="allowed_token_ids")
    return ids


def make_sampling_params(kwargs: dict) -> SamplingParams:
    try:
        params = SamplingParams(**kwargs)   # validated by its __post_init__
    except SamplingParamsError as exc:
        raise APIError(str(exc), param=getattr(exc, "param", None)) from None
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc)) from None
    return params


# ---- /v1/completions -----------------------------------------------------------------------------

def _completion_prompts(body: dict) -> list[Prompt]:
    p = body.get("prompt")
    if p is None:
        raise APIError("'prompt' is required", param="prompt")
    if isinstance(p, str):
        return [_text(p, "prompt")]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [_text(x, "prompt") for x in p]
        if all(_is_int(x) for x in p):
            return [list(p)]
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return [list(x) for x in p]
    raise APIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                   "non-empty token-id lists", param="prompt")


def parse_completion(body: dict, served_model_names: list[str]) -> GenerationRequest:
    common = _common(body, "completion", served_model_names)
    prompts = _completion_prompts(body)
    if body.get("suffix"):
        raise APIError("'suffix' is not supported", param="suffix")
    logprobs = get_int(body, "logprobs", None, ge=0, le=MAX_LOGPROBS)
    echo = get_bool(body, "echo")
    # vLLM's rule (0.32): 16 when the field is absent or null (OpenAI's default), capped at what the context leaves.
    # With echo, 0 is allowed (vLLM's and OpenAI's legacy scoring call): the prompt back, with its logprobs when
    # asked; one token is generated and dropped.
    max_tokens = get_int(body, "max_tokens", 16, ge=0 if echo else 1)
    echo_only = echo and max_tokens == 0
    params = _sampling(body, 1 if echo_only else max_tokens, logprobs)
    if echo and logprobs is not None:   # the prompt's tokens' logprobs come first (the first token has none)
        params.prompt_logprobs = logprobs
    if common["prompt_logprobs"] is not None:   # vLLM's field; echo's logprobs then show at most `logprobs` top
        params.prompt_logprobs = max(common["prompt_logprobs"], params.prompt_logprobs or 0)
    return _checked(GenerationRequest(prompts=prompts, params=params, max_tokens_given=max_tokens is not None,
                                      echo=echo, logprobs=logprobs, echo_only=echo_only,
                                      body=body, **common))


# ---- /v1/chat/completions ------------------------------------------------------------------------

def _messages(body: dict) -> list[dict]:
    """Each message's role and text content, and what chat templates read of tool calls: an assistant's
    ``tool_calls`` (arguments as an object), a tool's ``tool_call_id``, a ``name``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a 'role'", param="messages")
        if m.get("content", "") is None and m["role"] != "assistant":   # vLLM's (OpenAI's) rule; absent is ""
            raise APIError(f"messages[{i}].content may be null only in an assistant message", param="messages")
        try:
            content = message_text(m.get("content"), i)
        except InvalidRequestError as exc:
            raise APIError(str(exc), param=exc.param) from None
        message = {"role": _text(m["role"], "messages"), "content": _text(content, "messages")}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _history_tool_calls(m["tool_calls"], i)
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise APIError(f"messages[{i}].{name} must be a string", param="messages")
                message[name] = _text(m[name], "messages")
        out.append(message)
    return out


def _history_tool_calls(calls, i: int) -> list[dict]:
    """An earlier answer's tool calls, as templates take them: arguments as an object (the JSON text parsed; an
    object given as such is kept; empty, or text that is no JSON object, is {}: a bad turn in the history must
    not fail every later request of the conversation, vLLM's reasoning too)."""
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise APIError(f"messages[{i}].tool_calls entries must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"arguments\": ...}}}}, got {short_repr(call)}", param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


def request_chat_template(body: dict, trusted: bool) -> str | None:
    """vLLM's rule: a request's ``chat_template`` (any string, "" too) is a 400 unless the server trusts them (a
    template is code the server runs); trusted, "" is the model's own."""
    template = get_str(body, "chat_template")
    param = "chat_template"
    kwargs = body.get("chat_template_kwargs")
    if template is None and isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        # vLLM's older way, still taken: the template in chat_template_kwargs, under the same trust rule
        template, param = kwargs["chat_template"], "chat_template_kwargs"
        if not isinstance(template, str):
            raise APIError(f"'chat_template_kwargs.chat_template' must be a string, got {short_repr(template)}",
                           param=param)
        _text(template, param)
    if template is not None and not trusted:
        raise APIError(f"'{param}' gives a chat template but this server does not take a request's chat template: "
                       "start it with --trust-request-chat-template (a pool: its router and its nodes)", param=param)
    return template or None


def chat_template_kwargs(body: dict) -> dict | None:
    """A request's ``chat_template_kwargs``: more variables for the chat template (``enable_thinking``, say). As in
    vLLM, ``tokenize`` is refused, and ``chat_template`` is the request's template (``request_chat_template``), no
    variable."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise APIError(f"'chat_template_kwargs' must be an object of template variables, got {short_repr(kwargs)}",
                       param="chat_template_kwargs")
    if "tokenize" in kwargs:
        raise APIError("'chat_template_kwargs' may not set 'tokenize'", param="chat_template_kwargs")
    return {k: v for k, v in kwargs.items() if k != "chat_template"} or None


def _check_continuation(messages: list[dict], add_generation_prompt: bool) -> None:
    """vLLM's refusals for ``continue_final_message``: the model goes on with the last message, so it must be the
    assistant's, and no new assistant turn may be opened after it (``add_generation_prompt`` defaults to true)."""
    if add_generation_prompt:
        raise APIError("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true (send "
                       "'add_generation_prompt': false to continue the final message)", param="add_generation_prompt")
    if messages[-1]["role"] != "assistant":
        raise APIError(f"'continue_final_message' needs the last message to be the assistant's, got role "
                       f"{short_repr(messages[-1]['role'])}", param="messages")


def render_chat_prompt(body: dict, messages: list[dict], tools: list[dict] | None, render,
                       trust_chat_template: bool) -> tuple[str, bool]:
    """A chat body's prompt, as chat completions and ``/tokenize`` render it (``render`` as ``parse_chat`` takes
    it), and its ``add_generation_prompt``: the two flags, the request's template and kwargs, every failure a 400
    naming its field."""
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final_message = get_bool(body, "continue_final_message")
    if continue_final_message:
        _check_continuation(messages, add_generation_prompt)
    chat_template = request_chat_template(body, trust_chat_template)
    template_kwargs = chat_template_kwargs(body)
    try:
        prompt = render(messages, add_generation_prompt, continue_final_message, tools, chat_template, template_kwargs)
    except InvalidRequestError as exc:
        raise APIError(str(exc), param=exc.param) from None
    except Exception as exc:  # noqa: BLE001 - a template error is the client's message list or template
        raise APIError(f"cannot apply the chat template: {exc}",
                       param="chat_template" if chat_template else "messages") from None
    return prompt, add_generation_prompt


def parse_chat(body: dict, served_model_names: list[str], render, tool_parser: str | None = None, *,
               trust_chat_template: bool = False) -> GenerationRequest:
    """``render(messages, add_generation_prompt, continue_final_message, tools, chat_template, template_kwargs) ->
    str`` applies the request's ``chat_template`` (taken only with ``trust_chat_template``, the server's
    ``--trust-request-chat-template``), or the tokenizer's
    chat template. ``tool_parser``: the server's for ``tool_choice`` "auto" (None: auto is refused)."""
    common = _common(body, "chat", served_model_names)
    messages = _messages(body)
    tools, tool_choice = parse_tools(body, tool_parser) if not _TOOL_FIELDS.isdisjoint(body) else (None, None)
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, ge=0, le=MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise APIError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    legacy_max_tokens = get_int(body, "max_tokens", None, ge=1)   # checked even when the new name wins
    max_tokens = get_int(body, "max_completion_tokens", None, ge=1)
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    prompt, add_generation_prompt = render_chat_prompt(body, messages, tools, render, trust_chat_template)
    response_role = "assistant" if add_generation_prompt else messages[-1]["role"]
    echo = get_bool(body, "echo") and messages[-1]["role"] == response_role
    # vLLM's chat echo: the last message, when its role is the answer's, starts the answer (with
    # continue_final_message, the whole message then: its given start and the continuation)
    chat_echo = messages[-1]["content"] if echo else ""
    # Without max_tokens (None) the engine fills the rest of the context.
    params = _sampling(body, max_tokens, logprobs)
    params.prompt_logprobs = common["prompt_logprobs"]
    if tool_choice is not None and tool_choice.parser == "hermes":
        # vLLM's hermes parser: some models' <tool_call> and </tool_call> are special tokens (Hermes 2 Pro's, say);
        # skipped in the text, no call could be read from it
        params.skip_special_tokens = False
    if tool_choice is not None and tool_choice.schema is not None:   # "auto" leaves the output free
        if params.structured_outputs is not None:
            raise APIError(f"'{params.structured_outputs.param}' and 'tool_choice' {short_repr(body['tool_choice'])} "
                           f"both constrain the output: send one of them", param=params.structured_outputs.param)
        params.structured_outputs = StructuredOutputs("json", tool_choice.schema, param="tools")
    return _checked(GenerationRequest(prompts=[prompt], params=params, max_tokens_given=max_tokens is not None,
                                      logprobs=logprobs, tool_choice=tool_choice, response_role=response_role,
                                      chat_echo=chat_echo, body=body, **common))


def parse_translated_chat(chat: dict, parse_chat, names: dict[str, str]) -> GenerationRequest:
    """A chat body translated from another API's request (Responses, Anthropic Messages), parsed by
    ``parse_chat(chat) -> GenerationRequest`` (the node's or the router's); ``names`` maps a chat field to the field
    the client sent, so a refusal (now, or the engine's of a constraint later) names what the client wrote."""
    try:
        req = parse_chat(chat)
    except APIError as err:
        err.param = names.get(err.param, err.param)
        raise
    structured = req.params.structured_outputs
    if structured is not None and structured.param in names:
        req.params.structured_outputs = dataclasses.replace(structured, param=names[structured.param])
    return req


# What vLLM's beam search reads of a request: n (the width), max_tokens, ignore_eos, length_penalty,
# include_stop_str_in_output, skip_special_tokens (and temperature, which cannot change its answer). Each of these
# SamplingParams fields it drops without a word; here one that is set is a 400 (body field, its default).
_BEAM_IGNORES = (("stop", []), ("stop_token_ids", []), ("min_tokens", 0), ("top_p", 1.0), ("top_k", 0),
                 ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                 ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None))
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2   # each step asks for 2 * n logprobs


def _check_beam_search(req: GenerationRequest) -> None:
    """What beam search cannot take: a 400 naming the field. vLLM refuses a streamed completion and a width whose
    2n logprobs pass 20; it ignores the rest, which would answer another request than the one sent."""
    def refuse(param: str, why: str):
        raise APIError(f"'{param}' {why} with 'use_beam_search'", param=param)

    if req.n > MAX_BEAM_WIDTH:
        refuse("n", f"(the beam width) must be at most {MAX_BEAM_WIDTH}")
    if req.stream and req.kind != "chat":
        refuse("stream", "is not supported (vLLM's rule: a completion's beams come whole)")
    if req.kv_transfer_params:
        refuse("kv_transfer_params", "is not supported (a search runs one token a step, on one node)")
    for param, given in (("logprobs", req.logprobs is not None), ("echo", req.echo),
                         ("prompt_logprobs", req.params.prompt_logprobs is not None),
                         ("tool_choice", req.tool_choice is not None and req.tool_choice.schema is not None)):
        if given:
            refuse(param, "is not supported")
    if req.params.structured_outputs is not None:
        refuse(req.params.structured_outputs.param, "(a constraint) is not supported")
    for name, default in _BEAM_IGNORES:
        value = getattr(req.params, name)
        if (value or None) != (default or None) and not (name == "top_k" and value == -1):   # [], {}, 0: unset
            refuse(name, "has no effect (vLLM's beam search ignores it)")


def _checked(req: GenerationRequest) -> GenerationRequest:
    """Checks across fields, once the request is parsed."""
    if req.use_beam_search:
        _check_beam_search(req)
    seed = req.params.seed
    if seed is not None and req.n > 1 and seed + req.n - 1 > SEED_MAX:  # choice j is seeded seed + j
        raise APIError(f"'seed' must be <= {SEED_MAX - req.n + 1} with n={req.n} (choice j uses seed + j)",
                       param="seed")
    if req.kv_transfer_params and req.params.prompt_logprobs is not None:
        raise APIError("'echo' with 'logprobs' (the prompt's logprobs) needs the whole prompt computed on one node: "
                       "send it without kv_transfer_params", param="kv_transfer_params")
    if req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"):
        # A prefill node hands back one KV handle per response: one choice, in one JSON body.
        if req.stream:
            raise APIError("'stream' must be false with kv_transfer_params.do_remote_decode (a prefill request "
                           "returns one KV handle in its JSON body)", param="stream")
        if req.n != 1:
            raise APIError("'n' must be 1 with kv_transfer_params.do_remote_decode (one KV handle per request)",
                           param="n")
        if len(req.prompts) != 1:
            raise APIError("'prompt' must be a single prompt with kv_transfer_params.do_remote_decode (one KV "
                           "handle per request)", param="prompt")
    return req
