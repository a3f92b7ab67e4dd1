"""Structured output through the OpenAI API, with the official client: ``response_format`` (JSON mode, JSON schema),
vLLM's ``structured_outputs`` and its older ``guided_*`` fields, streamed and not, several choices, and the 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from test_server_errors import assert_error, post

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer", "minimum": 0}}}
ASK = [{"role": "user", "content": "Give me a city and its population as JSON."}]


def test_chat_json_schema_with_the_openai_client(client):
    r = client.chat.completions.create(
        model="demo", messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CITY)


def test_chat_json_mode_streamed(client):
    chunks = client.chat.completions.create(model="demo", messages=ASK, max_tokens=80, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.lstrip().startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[A-Z][a-z]+ [0-9]{2}"}}, lambda t: re.fullmatch("[A-Z][a-z]+ [0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
    ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_json": json.dumps(CITY)}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch("x[0-9]{2}", t)),
])
def test_completions_constraints_with_n_choices(client, extra, check):
    r = client.completions.create(model="demo", prompt="The answer:", max_tokens=60, temperature=0.9, seed=4, n=2,
                                  extra_body=extra)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_constrained_and_plain_requests_side_by_side(client):
    """Concurrent requests share batches: a plain one answers as it does alone, each constrained one its own."""
    def plain():
        return client.completions.create(model="demo", prompt="The ocean is", max_tokens=10, temperature=0).choices[0]

    alone = plain().text

    def constrained(i):
        return client.completions.create(model="demo", prompt="Pick:", max_tokens=10, temperature=0.8, seed=i,
                                         extra_body={"structured_outputs": {"choice": [f"c{i}a", f"c{i}b"]}})

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(constrained, i) for i in range(5)] + [pool.submit(plain)]
        results = [f.result() for f in futures]
    for i, r in enumerate(results[:5]):
        assert r.choices[0].text in (f"c{i}a", f"c{i}b")
    assert results[5].text == alone


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"response_format": "json"}, "response_format"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, extra, param):
    body = {"model": "demo", "max_tokens": 4, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    assert_error(post(server, path, body), 400, param=param)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": ["7"]}, "min_tokens": 4},   # the finished grammar allows only EOS
    {"guided_regex": "[0-9]{3}x{1000000}"},   # llguidance's lexer gives up while it is built, after 3 digits
])
def test_a_constraint_that_breaks_while_generating_is_400(server, extra):
    """The client's own constraint, found unsatisfiable only token by token: a 400 naming the field (not a 500),
    and the server goes on serving."""
    body = {"model": "demo", "prompt": "Numbers:", "max_tokens": 8, "temperature": 0, **extra}
    r = post(server, "/v1/completions", body)
    assert_error(r, 400, param=next(k for k in extra if k != "min_tokens"))
    assert "<state>" not in r.json()["error"]["message"]
    ok = post(server, "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": None}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": 7}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 7}}}, "response_format"),
    ({"parallel_tool_calls": {}}, "parallel_tool_calls"),
])
def test_options_beside_a_constraint_are_type_checked(server, extra, param):
    """Found by schemathesis: these were taken whatever their type (answered 200)."""
    body = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


FLAG = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
# "JSON" is in the demo model's greedy answer below: there the segment starts, its JSON forced, then the end
TAGS = {"structures": [{"begin": "JSON=", "schema": FLAG, "end": ";"}], "triggers": ["JSON"]}
TAGGED = re.compile(r"JSON=(\{.*?\});", re.S)
PROMPT = "Write a JSON object with a boolean field ok. The object"


def tagged_segments(text: str) -> list:
    """Each tagged segment's JSON, checked against its schema; every trigger in ``text`` starts one."""
    found = [json.loads(m) for m in TAGGED.findall(text)]
    for value in found:
        jsonschema.validate(value, FLAG)
    assert text.count("JSON") == text.count("JSON=") == len(found) + (not text.endswith(";") and text.count("JSON=")
                                                                      > len(found))
    return found


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"structural_tag": json.dumps(TAGS)}},   # vLLM's field takes JSON text
    {"structured_outputs": {"structural_tag": TAGS}},
    {"response_format": {"type": "structural_tag", **TAGS}},
])
def test_structural_tag_constrains_what_follows_a_trigger(client, extra):
    """Free text until the trigger, then the begin string, JSON of the schema and the end string (greedy: the
    model's answer has the trigger; then sampled with a seed, where every trigger must start a valid segment)."""
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    assert "JSON" in plain and "JSON=" not in plain, plain
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    text = r.choices[0].text
    assert text.startswith(plain[:plain.index("JSON")] + "JSON="), (plain, text)   # free text before the trigger
    assert tagged_segments(text), text
    sampled = client.completions.create(model="demo", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=3, n=2,
                                        extra_body=extra)
    for c in sampled.choices:
        tagged_segments(c.text)


def test_structural_tag_on_chat_streamed(client):
    chunks = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Write a JSON object with a boolean field ok."}],
        max_tokens=60, temperature=0, stream=True, response_format={"type": "structural_tag", **TAGS})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tagged_segments(text)


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"structural_tag": ""}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<a"]}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {**TAGS, "triggers": ["<other"]}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {**TAGS, "triggers": [""]}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}],
                                                "triggers": ["<a"]}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"structures": [{"begin": "<a>", "schema": {"type": 7},
                                                                "end": "</a>"}], "triggers": ["<a"]}}},
     "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"structures": [{"begin": 1, "schema": {}, "end": "</a>"}],
                                                "triggers": ["<a"]}}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "structures": TAGS["structures"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}},
     "response_format"),   # xgrammar's newer shape: vLLM's guidance backend refuses it too
    ({"response_format": {"type": "structural_tag", **TAGS}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_structural_tags_are_400_naming_the_field(server, extra, param):
    body = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)
