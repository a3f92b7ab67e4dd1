"""``--trust-request-chat-template`` reaches both processes that render a chat request's own template, the nodes
and the router (which renders it to hash the prompt), from the CLI and the InferencePool spec
(``model.trustRequestChatTemplate``, read by ``pdpool up`` and the operator alike)."""

from __future__ import annotations

from operator_examples import make_body
from pdpool import config
from pdpool.operator.builders.nodes import node_config
from pdpool.operator.builders.router import router_config
from pdpool.operator.spec import parse_pool
from pdpool.router import settings


def test_the_flag_and_the_pool_spec_set_nodes_and_router():
    router, _ = settings.load(["--trust-request-chat-template"])
    assert router.router.trust_request_chat_template
    pool = parse_pool(make_body({"model": {"trustRequestChatTemplate": True}}))
    for role in ("prefill", "decode"):
        assert "--trust-request-chat-template" in config.to_argv(node_config(pool, role))
    assert "--trust-request-chat-template" in config.to_argv(router_config(pool), config.RouterCommandConfig)
    default = parse_pool(make_body({}))
    assert "--trust-request-chat-template" not in config.to_argv(node_config(default, "decode"))


def test_the_pool_specs_chat_template_reaches_nodes_and_router():
    """``model.chatTemplate`` (vLLM's ``--chat-template``: the jinja text, or a path inside the pods) goes to both
    processes that render chats, so the router hashes the prompt the nodes compute."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pool = parse_pool(make_body({"model": {"chatTemplate": template}}))
    for argv in (config.to_argv(node_config(pool, "prefill")), config.to_argv(node_config(pool, "decode")),
                 config.to_argv(router_config(pool), config.RouterCommandConfig)):
        assert argv[argv.index("--chat-template") + 1] == template
    assert "--chat-template" not in config.to_argv(node_config(parse_pool(make_body({})), "decode"))
