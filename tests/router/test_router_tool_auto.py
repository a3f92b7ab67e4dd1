"""``tool_choice: "auto"`` through a router: it validates requests with the nodes' own code, so it accepts auto
where it is configured as its nodes are (``--enable-auto-tool-choice --tool-call-parser``) and refuses it, as
they do, where it is not. One colocated node behind static routers: the cheap setup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_server_tool_auto import TOOLS, few_shot  # noqa: E402

AUTO = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def node(launch_server):
    srv = launch_server("--dtype", "float32", "--max-model-len", "1024", *AUTO)
    yield srv
    srv.stop()


def test_a_configured_router_serves_auto_and_an_unconfigured_one_refuses_it(node, start_router):
    configured = start_router(["--both", node.url, *AUTO], name="router-auto")
    r = configured.client().chat.completions.create(model="demo", messages=few_shot("hermes"), tools=TOOLS,
                                                    temperature=0, max_tokens=48)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Berlin"}

    plain = start_router(["--both", node.url], name="router-no-auto")
    body = {"model": "demo", "messages": few_shot("hermes"), "tools": TOOLS, "max_tokens": 8}
    refused = plain.post("/v1/chat/completions", body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in refused.json()["error"]["message"]
