"""``--chat-template`` (vLLM's flag): a file's path or the jinja text itself, in place of the model's template, on
``pdpool serve``, ``pdpool router`` and the pool spec (``model.chatTemplate``); a value that is neither is the
command line's error (exit status 2), before anything listens."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from pdpool import cli
from pdpool.frontend import ChatTemplateError, Frontend, Tokenizer, load_chat_template
from pdpool.router import settings as router_settings

# A template no model ships: every message as "<role>|<content>;", and "=>" to prompt the answer.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}|{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
RENDERED = "system|Be brief.;user|Name a colour.;=>"


def test_a_file_path_and_the_text_itself_both_give_the_template(tmp_path, demo_model_dir):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE + "\n")
    assert load_chat_template(str(path)) == TEMPLATE + "\n"
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # As a shell user types it on one line: the escape is undone, as vLLM does; other text is kept, accents included.
    assert load_chat_template("{{ 'é' }}\\n{{ messages[0]['content'] }}") == "{{ 'é' }}\n{{ messages[0]['content'] }}"
    tok = Tokenizer(demo_model_dir, str(path))
    assert tok.apply_chat_template(MESSAGES) == RENDERED   # jinja drops a single trailing newline
    model = Frontend.from_model(str(demo_model_dir))
    assert model.tokenizer.apply_chat_template(MESSAGES) != tok.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("value, says", [
    ("/no/such/dir/template.jinja", "looks like a file path, but it cannot be read"),
    ("chat_template.jinja", "looks like a file path, but it cannot be read"),
    ("{% for m in messages %}{{ m }}", "is not a valid jinja template"),
])
def test_a_value_that_is_neither_a_readable_file_nor_a_template_is_refused(value, says):
    with pytest.raises(ChatTemplateError, match=says):
        load_chat_template(value)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="{}\\\n", blacklist_categories=("Cs",)), max_size=40))
def test_any_text_without_template_characters_is_a_path_that_failed_unless_it_is_a_file(value):
    """Never taken as a template (a mistyped path must not become a template that ignores every message)."""
    try:
        load_chat_template(value)
    except ChatTemplateError as exc:
        assert "looks like a file path" in str(exc)
    else:   # it named a readable file ("" is the working directory: not a file)
        assert value and __import__("pathlib").Path(value).is_file()


def test_serve_refuses_a_bad_template_before_loading_anything(capsys):
    assert cli.main(["serve", "--chat-template", "/no/such/template.jinja"]) == 2
    assert "--chat-template '/no/such/template.jinja' looks like a file path" in capsys.readouterr().err
    assert cli.main(["serve", "--chat-template", "{% if %}"]) == 2
    assert "is not a valid jinja template" in capsys.readouterr().err


def test_router_takes_the_flag_and_refuses_a_bad_template():
    cfg, _ = router_settings.load(["--chat-template", TEMPLATE])
    assert cfg.router.chat_template == TEMPLATE
    r = subprocess.run([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--both",
                        "http://127.0.0.1:9", "--chat-template", "/no/such/template.jinja"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pdpool router: error: --chat-template '/no/such/template.jinja' looks like a file path" in r.stderr


def test_a_node_renders_chats_with_the_given_template(launch_server, tmp_path, demo_model_dir):
    """Chat completions and /tokenize render with the flag's template: the prompt's token count is that of the
    custom rendering, not the model's."""
    path = tmp_path / "custom.jinja"
    path.write_text(TEMPLATE)
    node = launch_server("--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "2",
                         "--chat-template", str(path))
    try:
        tok = Tokenizer(demo_model_dir)
        ids = tok.encode(RENDERED, add_special_tokens=False)
        r = httpx.post(f"{node.url}/tokenize", json={"model": "demo", "messages": MESSAGES}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == ids
        chat = node.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2, temperature=0)
        assert chat.usage.prompt_tokens == len(ids)
    finally:
        node.stop()
