"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, answered from the shared front end by a node and by the
router alike (the router has the model's tokenizer and chat template; no node is asked).

    /tokenize    {"prompt": "text"}           -> {"count", "max_model_len", "tokens", "token_strs"}
                 {"messages": [...], ...}        the chat template applied first, as /v1/chat/completions does
    /detokenize  {"tokens": [ids]}            -> {"prompt": "text"}

Defaults are vLLM's: ``add_special_tokens`` true for a prompt and false for messages (the template already holds
them), ``add_generation_prompt`` true, special tokens kept when decoding. ``model`` is optional; a name not
served is a 404. Token ids outside the vocabulary are a 400, never a tokenizer panic.
"""

from __future__ import annotations

from pdpool.frontend import Frontend, InvalidRequestError, check_token_ids
from pdpool.server.errors import APIError
from pdpool.server.protocol import _messages, _text, get_bool, model_not_found, render_chat_prompt, short_repr
from pdpool.server.tools import read_tools


def _check_model(body: dict, served_model_names: list[str]) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    if model and model not in served_model_names:   # "", as null, is the served model (vLLM's rule)
        raise model_not_found(model, served_model_names)


def tokenize(body: dict, frontend: Frontend, served_model_names: list[str], max_model_len: int | None, *,
             trust_chat_template: bool = False) -> dict:
    """The answer to ``POST /tokenize``; raises ``APIError``. ``messages`` render with the request's
    ``chat_template`` as a chat request's do (taken only with ``trust_chat_template``)."""
    _check_model(body, served_model_names)
    if ("prompt" in body) == ("messages" in body):
        raise APIError("send either 'prompt' (text) or 'messages' (a chat), not both or neither", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(f"'prompt' must be a string, got {short_repr(prompt)}", param="prompt")
        text = _text(prompt, "prompt")
        add_special = get_bool(body, "add_special_tokens", True)
    else:
        messages = _messages(body)
        tools = read_tools(body["tools"]) if body.get("tools") is not None else None
        text, _ = render_chat_prompt(body, messages, tools, frontend.render_chat, trust_chat_template)
        add_special = get_bool(body, "add_special_tokens", False)
    ids = frontend.tokenizer.encode(text, add_special_tokens=add_special)
    strs = frontend.tokenizer.convert_ids_to_tokens(ids) if get_bool(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, frontend: Frontend, served_model_names: list[str]) -> dict:
    """The answer to ``POST /detokenize``; raises ``APIError``."""
    _check_model(body, served_model_names)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise APIError(f"'tokens' must be a list of token ids, got {short_repr(ids)}", param="tokens")
    try:
        check_token_ids(ids, frontend.vocab_size, "tokens")
    except InvalidRequestError as exc:
        raise APIError(str(exc), param="tokens") from None
    return {"prompt": frontend.tokenizer.decode(ids, skip_special_tokens=False)}
