"""schemathesis (an independent OpenAPI fuzzer) run as ``st run --checks all --mode all`` runs it, against a live
``/openapi.json``: every check (no 5xx, documented status codes and content types, schema-valid bodies accepted
and schema-invalid ones refused, authentication enforced as documented, 405 and Allow for undocumented methods),
positive and negative data, over the examples, coverage and fuzzing phases (stateful testing needs links between
operations, which the API has none of).

Only the requests are shaped, never the checks: generation lengths are capped (``max_tokens`` at most
``MAX_TOKENS``, ``n`` at most 2), so that a schema-valid request for the whole context cannot keep a CPU node
busy for minutes, prompts are cut to fit a 512-token context, and the rules across fields that JSON Schema cannot
say are kept; schemathesis classifies a changed body again (valid or not) before it checks the answer.
``PDPOOL_SCHEMATHESIS_EXAMPLES`` (default 20 per operation and mode) makes a longer run.
"""

from __future__ import annotations

import os

EXAMPLES = int(os.environ.get("PDPOOL_SCHEMATHESIS_EXAMPLES", "20"))
MAX_TOKENS = 3
TEXT = 64   # characters of a prompt, or of a chat's messages together


def load(url: str, api_key: str | None):
    import schemathesis

    config = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
        "request-timeout": 60,
        "generation": {"mode": "all", "max-examples": EXAMPLES, "database": "none", "deterministic": True},
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
                   "stateful": {"enabled": False}},
    })
    return schemathesis.openapi.from_url(url + "/openapi.json", config=config)


def shape(context, case, kwargs) -> None:
    """schemathesis' ``before_call`` hook (every phase calls it; the case is classified again after it)."""
    case.body = with_cross_field_rules(context.operation, bounded(context.operation, case.body))


def bounded(operation, body):
    """``body``, capped in what a generation request may cost (see the module's docstring)."""
    if not (isinstance(body, dict) and operation.path.startswith("/v1/") and operation.method.upper() == "POST"):
        return body
    for name, most in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("min_tokens", MAX_TOKENS),
                       ("max_output_tokens", MAX_TOKENS), ("n", 2), ("best_of", 2)):
        if _number(body.get(name)) and body[name] > most:   # 3e9 and 3.0e9 alike: JSON Schema integers
            body[name] = most
    if operation.path == "/v1/responses":
        _bounded_response(body)
        return body
    if operation.path.startswith("/v1/messages"):   # Anthropic's: max_tokens required (capped above), system cut
        system = body.get("system")
        if isinstance(system, str):
            body["system"] = system[:TEXT // 4]
        elif isinstance(system, list):
            body["system"] = system[:2]
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS     # absent or null: the rest of the context
    # The prompt within the context (512 tokens): a character may be 4 byte-level tokens
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = _tokenizable(prompt[:TEXT])
    elif isinstance(prompt, list):
        body["prompt"] = [_tokenizable(p[:TEXT]) if isinstance(p, str) else p[:TEXT] if isinstance(p, list) else p
                          for p in prompt[:4]][:TEXT]
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = messages = messages[:4]
        for m in messages:
            for key in ("role", "content"):
                if isinstance(m, dict) and isinstance(m.get(key), str):
                    m[key] = m[key][:TEXT // 4]
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = m["content"][:2]
                for part in m["content"]:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = part["text"][:TEXT // 8]
    return body


def _bounded_response(body: dict) -> None:
    """A Responses body's part of ``bounded``: max_output_tokens, and its input and instructions cut."""
    if body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_TOKENS
    if isinstance(body.get("instructions"), str):
        body["instructions"] = body["instructions"][:TEXT // 4]
    items = body.get("input")
    if isinstance(items, str):
        body["input"] = items[:TEXT]
    elif isinstance(items, list):
        body["input"] = items = items[:4]
        for item in items:
            for key in ("content", "output", "arguments"):
                if isinstance(item, dict) and isinstance(item.get(key), str):
                    item[key] = item[key][:TEXT // 4]
                elif isinstance(item, dict) and isinstance(item.get(key), list):
                    item[key] = item[key][:2]
                    for part in item[key]:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            part["text"] = part["text"][:TEXT // 8]


def _tokenizable(text: str) -> str:
    """A text prompt the tokenizer keeps something of: one of control characters alone (``"\\x13"``) tokenizes to
    no token, an empty prompt (a 400, as in vLLM), which JSON Schema cannot tell from text."""
    return text if not text or any(c.isprintable() for c in text) else text + "x"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar")
# Constraints that compile and leave room for any min_tokens: what a schema-valid schema, regex or grammar becomes
COMPILING = {"json": {"type": "object"}, "regex": "[a-z ]{0,64}", "grammar": 'start: /[a-z ]{0,64}/'}
CHOICES = ["yes", "no"]
TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}


def with_cross_field_rules(operation, body):
    """The rules across fields JSON Schema cannot say (the document's descriptions say them), kept: best_of equals
    n; continue_final_message continues the last message, which must be the assistant's; one structured-output
    field at most, whose schema, regex or grammar compiles (schema-valid ones are replaced by one that does), and
    without min_tokens, allowed_token_ids or bad_words beside it (together they may leave no token to sample)."""
    if not isinstance(body, dict):
        return body
    if operation.path == "/v1/responses":
        _response_rules(body)
        return body
    if operation.path == "/v1/messages":
        _anthropic_rules(body)
        return body
    _tools_that_compile(body)
    _one_compiling_constraint(body)
    _beam_search_alone(operation, body)
    n = body.get("n")
    if _number(body.get("best_of")) and 1 <= body["best_of"] <= 16:
        body["best_of"] = n if _number(n) and 1 <= n <= 16 else 1
    messages = body.get("messages")
    if body.get("continue_final_message") is True and isinstance(messages, list) and messages \
            and isinstance(messages[-1], dict):
        messages[-1]["role"] = "assistant"
    return body


def _one_compiling_constraint(body: dict) -> None:
    given = [f for f in STRUCTURED if body.get(f) is not None
             and not (f == "response_format" and isinstance(body[f], dict) and body[f].get("type") == "text")]
    for extra in given[1:]:
        del body[extra]
    if not given:
        return
    for masks in ("min_tokens", "allowed_token_ids", "bad_words"):   # with a grammar they may leave no token
        body.pop(masks, None)
    field, value = given[0], body[given[0]]
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}.get(field)
    if kind is not None and isinstance(value, (dict, bool, str) if kind == "json" else str) and value != "":
        body[field] = COMPILING[kind]
    elif field == "guided_choice" and _words(value):
        body[field] = CHOICES
    elif field == "structured_outputs" and isinstance(value, dict):
        for key, good in COMPILING.items():
            if isinstance(value.get(key), (dict, bool, str) if key == "json" else str) and value[key] != "":
                value[key] = good
        if _words(value.get("choice")):
            value["choice"] = CHOICES
        if isinstance(value.get("structural_tag"), (dict, str)) and value["structural_tag"] != "":
            value["structural_tag"] = TAG   # a begin no trigger starts, or a schema that does not compile: a 400
    elif field == "response_format" and isinstance(value, dict) and value.get("type") == "structural_tag" \
            and isinstance(value.get("structures"), list) and value["structures"]:
        value.update(TAG)
    elif field == "response_format" and isinstance(value, dict) and isinstance(value.get("json_schema"), dict) \
            and isinstance(value["json_schema"].get("schema"), (dict, bool)):
        value["json_schema"]["schema"] = COMPILING["json"]


# What a beam search refuses beside it (protocol._check_beam_search; the document's description lists them)
BEAM_REFUSES = ("logprobs", "top_logprobs", "echo", "prompt_logprobs", "kv_transfer_params", "stop", "stop_token_ids",
                "min_tokens", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logit_bias", "allowed_token_ids", "bad_words", "tool_choice", *STRUCTURED)


def _beam_search_alone(operation, body: dict) -> None:
    if body.get("use_beam_search") is not True:
        return
    for name in BEAM_REFUSES:
        body.pop(name, None)
    if operation.path == "/v1/completions":
        body.pop("stream", None)
        body.pop("stream_options", None)


def _tools_that_compile(body: dict) -> None:
    """A named tool_choice names the first tool; each tool's parameters compile; a call's own grammar is the only
    constraint (tool calls with response_format or structured_outputs are refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (isinstance(tools, list) and tools and all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                      for t in tools)):
        return
    for tool in tools:
        if isinstance(tool["function"].get("parameters"), dict):
            tool["function"]["parameters"] = COMPILING["json"]
    first = tools[0]["function"].get("name")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and isinstance(first, str):
        choice["function"]["name"] = first
    if choice not in (None, "none"):
        for field in STRUCTURED:
            body.pop(field, None)
        for masks in ("min_tokens", "allowed_token_ids", "bad_words"):
            body.pop(masks, None)


def _response_rules(body: dict) -> None:
    """A Responses body's: text.format's schema and each tool's parameters compile, a named tool_choice names the
    first tool, a call's own grammar is the only constraint."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
        fmt["schema"] = COMPILING["json"]
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)):
        return
    for tool in tools:
        if isinstance(tool.get("parameters"), dict):
            tool["parameters"] = COMPILING["json"]
    if isinstance(choice, dict) and isinstance(tools[0].get("name"), str):
        choice["name"] = tools[0]["name"]
    if choice not in (None, "none", "auto"):
        body.pop("text", None)


def _anthropic_rules(body: dict) -> None:
    """A Messages body's: output_config's schema and each tool's input_schema compile, a named tool_choice names
    the first tool, a call's own grammar is the only constraint, thinking's budget_tokens below max_tokens."""
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        fmt["schema"] = COMPILING["json"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        body["thinking"] = {"type": "disabled"}
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)):
        return
    for tool in tools:
        if isinstance(tool.get("input_schema"), dict):
            tool["input_schema"] = COMPILING["json"]
    if isinstance(choice, dict) and choice.get("type") == "tool" and isinstance(tools[0].get("name"), str):
        choice["name"] = tools[0]["name"]
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        body.pop("output_config", None)


def _words(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)


def run(schema) -> tuple[int, list[str]]:
    """Every enabled phase: (cases sent, each failure and error with its curl line and the answer)."""
    from schemathesis.engine import events, from_schema

    import schemathesis

    cases, problems = 0, []
    schemathesis.hook("before_call")(shape)
    try:
        events_seen = list(from_schema(schema).execute())
    finally:
        schemathesis.hooks.GLOBAL_HOOK_DISPATCHER.unregister(shape)
    for event in events_seen:
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            cases += len(event.recorder.cases)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.failure_info is None:
                        continue
                    interaction = event.recorder.interactions.get(case_id)
                    answer = "" if interaction is None or interaction.response is None else (
                        f"{interaction.response.status_code} {interaction.response.content[:300]!r}")
                    failure = check.failure_info.failure
                    problems.append(f"{event.recorder.label}: {check.name}: {failure.title}\n{failure.message}\n"
                                    f"{check.failure_info.code_sample}\n-> {answer}")
        elif isinstance(event, events.NonFatalError):
            problems.append(f"{event.label}: error: {event.value!r}")
        elif isinstance(event, events.FatalError):
            raise event.exception
    return cases, sorted(set(problems))
