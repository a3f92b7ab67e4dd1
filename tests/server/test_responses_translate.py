"""``pdpool.server.responses.translate``: a Responses body -> the chat body it means (no server)."""

from __future__ import annotations

import pytest

from pdpool.server.errors import APIError
from pdpool.server.responses import translate


def make_body(**fields) -> dict:
    return {"model": "demo", "input": "Hi", **fields}


def test_a_string_input_is_one_user_message_and_instructions_a_system_one_first():
    chat = translate(make_body(instructions="Be brief.", max_output_tokens=5, temperature=0)).chat
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (chat["max_completion_tokens"], chat["temperature"], chat["stream"]) == (5, 0, False)
    assert "stream_options" not in chat


def test_items_become_chat_turns():
    chat = translate(make_body(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}])).chat
    assert chat["messages"] == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def test_a_last_assistant_message_in_progress_is_continued():
    chat = translate(make_body(input=[{"role": "user", "content": "Count"},
                                      {"role": "assistant", "content": "1, 2,", "status": "in_progress"}])).chat
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)


def test_stream_text_format_tools_and_logprobs_map_onto_chat():
    schema = {"type": "object"}
    chat = translate(make_body(stream=True, text={"format": {"type": "json_schema", "name": "s", "schema": schema}},
                               tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
                               tool_choice={"type": "function", "name": "f"}, top_logprobs=3,
                               include=["message.output_text.logprobs"])).chat
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)


def test_auto_or_none_without_tools_is_text_and_unknown_fields_are_not_passed():
    for choice in ("auto", "none"):
        chat = translate(make_body(tool_choice=choice, messages=[{"role": "x"}], n=3)).chat
        assert "tool_choice" not in chat and "n" not in chat
        assert chat["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_forced_tool_choice_without_tools_goes_to_chat_which_refuses_it():
    """vLLM 0.32's check_tool_usage: "required" or a named function without tools is a 400 naming tool_choice;
    the chat body keeps it, so chat's own refusal answers (tests/server/test_responses.py)."""
    assert translate(make_body(tool_choice="required")).chat["tool_choice"] == "required"
    assert translate(make_body(tool_choice={"type": "function", "name": "f"}, tools=[])).chat["tool_choice"] == \
        {"type": "function", "function": {"name": "f"}}


def test_echo_keeps_the_requests_settings():
    turn = translate(make_body(metadata={"a": "b"}, user="u", truncation="auto", store=False))
    assert turn.echo["metadata"] == {"a": "b"} and turn.echo["user"] == "u" and turn.echo["truncation"] == "auto"
    assert turn.chat["truncate_prompt_tokens"] == -1 and turn.echo["tool_choice"] == "auto"


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"), ({"background": 1}, "background"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"reasoning": {}}, "reasoning"),
    ({"conversation": "c"}, "conversation"), ({"enable_response_messages": True}, "enable_response_messages"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"), ({"input": [5]}, "input"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}, "input"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"), ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": "json"}, "text"), ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"include": ["message.output_text.logprobs", 3]}, "include"), ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"service_tier": "fast"}, "service_tier"), ({"max_tool_calls": -1}, "max_tool_calls"),
])
def test_refusals_name_the_responses_field(fields, param):
    with pytest.raises(APIError) as err:
        translate(make_body(**fields))
    assert err.value.param == param and err.value.status == 400
