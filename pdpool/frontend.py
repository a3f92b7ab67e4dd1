"""The request front end, shared by a node and the router: tokenizer, chat template, prompt validation, block hashes.

A node and the router must turn the same request into the same token ids and the same block hashes, or the
router's prefix scores are fiction. Both build a ``Frontend`` from the model folder and call it the same way::

    frontend = Frontend.from_model("demo")                    # or a local Hugging Face folder
    ids = frontend.encode_prompt(prompt, add_special_tokens)  # str or token ids -> validated ids
    text = frontend.render_chat(messages)                     # the model's chat template
    hashes = frontend.block_hashes(ids, fingerprint, salt)    # the engines' own prefix-cache hashes

The policy for special tokens is one rule: a completion prompt gets them (BOS where the tokenizer adds one); a
chat prompt does not, because the template already wrote them.

It reads ``tokenizer.json`` with the ``tokenizers`` library and renders the chat template with jinja2 the way
transformers does (a sandbox, ``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``); it never imports torch or transformers, so the router stays light. The one exception is the
demo model's first use, whose one-time GGUF conversion needs transformers (``pdpool.models.demo``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Sequence

from pdpool.block_hash import BlockHash, ModelFingerprint, hash_prompt_blocks, root_hash
from pdpool.token_cache import BlockHashMemo, TokenChunkCache


class InvalidRequestError(ValueError):
    """A request the front end or the engine refuses (empty prompt, token ids out of the vocabulary, too long);
    ``param`` names the request field for the API's 400."""

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelFiles:
    """What the front end reads of a model folder: plain JSON, no weights."""
    path: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]   # every id that ends generation (generation_config.json first, then config.json)
    max_position_embeddings: int | None = None   # the model's longest context (a node may serve less)

    @classmethod
    def read(cls, path: Path) -> "ModelFiles":
        config = _read_json(path / "config.json") or {}
        text_config = config.get("text_config") or {}
        vocab = config.get("vocab_size") or text_config.get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"{path}/config.json has no vocab_size")
        eos: list[int] = []
        generation = _read_json(path / "generation_config.json") or {}
        for value in (generation.get("eos_token_id"), config.get("eos_token_id")):
            for token in ([value] if isinstance(value, int) else value or []):
                if isinstance(token, int) and token not in eos:
                    eos.append(token)
        positions = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
        return cls(path, vocab, tuple(eos), positions if isinstance(positions, int) else None)


# The sampling fields a server's generation config gives defaults to (vLLM's): a request's own value wins.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request leaves unset gets from the model's generation config (``--generation-config``), as in vLLM."""
    sampling: dict            # DEFAULTABLE field -> value
    max_tokens: int | None = None       # a chat's budget when it gives none (``max_new_tokens``)
    max_tokens_cap: int | None = None   # every budget at most this: a folder's or the override's max_new_tokens

    @classmethod
    def read(cls, model_path: Path, source: str = "auto", override: dict | None = None) -> "GenerationDefaults":
        """``source``: 'auto' (the model folder's generation_config.json), 'vllm' (none) or a folder holding one;
        ``override``: ``--override-generation-config``, over it. ``ValueError`` for a folder without the file."""
        config: dict = {}
        if source != "vllm":
            folder = model_path if source == "auto" else Path(source)
            if source != "auto" and not (folder / "generation_config.json").is_file():
                raise ValueError(f"--generation-config {source}: no generation_config.json there")
            config = _read_json(folder / "generation_config.json") or {}
        override = override or {}
        config = {**config, **override}
        sampling = {name: config[name] for name in DEFAULTABLE if config.get(name) is not None}
        max_tokens = config.get("max_new_tokens")
        cap = max_tokens if source not in ("auto", "vllm") else override.get("max_new_tokens")
        return cls(sampling, max_tokens, cap)

    def __bool__(self) -> bool:
        return bool(self.sampling) or self.max_tokens is not None or self.max_tokens_cap is not None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# Text from this length on is tokenized with the GIL released, and a server tokenizes it off its event loop: a
# 20 MB prompt takes seconds, during which every other request on the loop (streams, /health) would stall.
LONG_TEXT_CHARS = 32768

# transformers' marker of where the final message's content ends (continue_final_message)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class Tokenizer:
    """A Hugging Face fast tokenizer read with ``tokenizers``: encode, decode, and the chat template."""

    SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        """``chat_template``: ``--chat-template``'s value (``load_chat_template``), in place of the model's."""
        from tokenizers import Tokenizer as _Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        self._tok = _Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json") or {}
        self.special_tokens = {name: _token_text(config.get(name)) for name in self.SPECIAL_NAMES}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = load_chat_template(chat_template) if chat_template else _chat_template(path, config)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= LONG_TEXT_CHARS:   # the same ids; ``tokenizers`` releases the GIL only in its batch call
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what llguidance builds its token trie from)."""
        return self._tok.to_str()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(t) for t in token_ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
        """``continue_final_message``: the text ends inside the last message (an assistant's partial answer, for
        the model to go on with), not after its end-of-turn tokens: transformers' way, which vLLM calls: render
        with a tag after that message's content, then cut the text at the tag. ``tools``: the request's, for
        templates that describe them to the model (vLLM passes them too; the demo model's template ignores them).
        ``chat_template``: a request's own template in place of the model's (the server decides whether to trust
        it); "" is the model's, as in vLLM. ``template_kwargs``: a request's ``chat_template_kwargs``, more
        variables for the template (``enable_thinking``, say); as in vLLM, only those the template reads are passed,
        and they never replace the messages, the tools or the two flags given here."""
        template = compile_chat_template(chat_template) if chat_template else self._template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template")
        if any(m.get("role") == "developer" for m in messages) and not names_developer(chat_template or
                                                                                        self.chat_template):
            messages = developer_as_system(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt are not compatible")
            if not messages:
                raise ValueError("continue_final_message is set but the conversation is empty")
            final = messages[-1]
            messages = [*messages[:-1], {**final, "content": final.get("content", "") + _CONTINUE_TAG}]
        variables = {k: v for k, v in self.special_tokens.items() if v}
        variables["documents"] = None
        if template_kwargs:
            read = template_variables(chat_template or self.chat_template)
            variables.update((k, v) for k, v in template_kwargs.items() if k in read)
        text = template.render(variables, messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=tools)
        try:   # the messages' text is checked before; a template variable's (a tool's, a kwarg's) is not
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("the rendered chat holds an unpaired UTF-16 surrogate escape (from a template "
                                      "variable)", param="chat_template_kwargs" if template_kwargs else
                                      "tools" if tools else "chat_template" if chat_template else "messages") from None
        if not continue_final_message:
            return text
        tag_at = text.rfind(_CONTINUE_TAG.strip())
        if tag_at < 0 or final.get("content", "").strip() not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                             "applying the chat template (the template drops part of it)")
        if text.startswith(_CONTINUE_TAG, tag_at):
            return text[:tag_at]
        return text[:tag_at].rstrip()  # the template trimmed the content's trailing space (and the tag's)

    @cached_property
    def _template(self):
        return None if self.chat_template is None else _chat_template_env().from_string(self.chat_template)


def names_developer(source: str) -> bool:
    """Whether a chat template knows OpenAI's ``developer`` role (vLLM's test: the quoted name in its text)."""
    return '"developer"' in source or "'developer'" in source


def developer_as_system(messages: list[dict]) -> list[dict]:
    """vLLM's (0.32) messages for a template that does not know the ``developer`` role: each developer message is a
    system one (without its ``tools``); when that leaves a system message past the first place, or more than one,
    every system message merges into one at the start, their non-empty texts joined by a blank line."""
    messages = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m.get("role") == "developer"
                else m for m in messages]
    if [i for i, m in enumerate(messages) if m.get("role") == "system"] == [0]:
        return messages
    texts = [m["content"] for m in messages if m.get("role") == "system" and m.get("content")]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m.get("role") != "system")]


@lru_cache(maxsize=1)
def _chat_template_env():
    """The jinja environment of every chat template, the model's and a request's: transformers' (a sandbox: a
    template reads its variables and calls no Python beyond these helpers)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_RENDER_ARGUMENTS = frozenset(("messages", "tools", "add_generation_prompt", "continue_final_message"))


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads and does not set itself, but those ``apply_chat_template`` passes."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_chat_template_env().parse(source))) - _RENDER_ARGUMENTS


@lru_cache(maxsize=32)
def compile_chat_template(source: str):
    """A request's chat template, compiled once for as long as it stays among the 32 most recently used (clients
    send the same few again and again); a syntax error raises jinja's ``TemplateSyntaxError`` (not cached)."""
    return _chat_template_env().from_string(source)


class ChatTemplateError(ValueError):
    """``--chat-template`` names no readable file and is no template, or its template does not compile."""


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as vLLM reads it: the text of the file it names; else, when it holds a brace or a
    line break, the template itself, its backslash escapes (``\\n``) undone as a shell user typed them. A value with
    neither that names no readable file is a path that failed. Compiled here, so that a template with a syntax
    error stops the command at start. Raises ``ChatTemplateError`` saying what is wrong."""
    from jinja2 import TemplateError

    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:   # ValueError: a NUL byte in the value
        if not any(c in value for c in "{}\n"):
            raise ChatTemplateError(f"--chat-template {value!r} looks like a file path, but it cannot be read ({exc})") from None
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        compile_chat_template(text)
    except TemplateError as exc:
        raise ChatTemplateError(f"--chat-template is not a valid jinja template: {exc}") from None
    return text


def _chat_template(path: Path, config: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template") or (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _clean_up_spaces(text: str) -> str:
    """The English-punctuation clean-up of older tokenizers (``clean_up_tokenization_spaces``)."""
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Token ids a request names (its prompt, ``stop_token_ids``) must be ints in the vocabulary."""
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"'{param}' must hold token ids in [0, {vocab_size}) (the vocab size); got {bad[:5]}",
                          param=param)


def message_text(content, i: int) -> str:
    """``messages[i]``'s content as chat templates take it: a string, None (""), or OpenAI's content parts, of which
    only text ones, joined one a line as vLLM joins them; anything else an ``InvalidRequestError`` (``messages``)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts",
                                  param="messages")
    return content


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` ids (-1: the last ``max_model_len``; None: all).
    A ``keep`` above the context length is an ``InvalidRequestError``, as in vLLM."""
    if keep is None:
        return token_ids
    if keep == -1:
        if max_model_len is None:
            return token_ids
        keep = max_model_len
    elif max_model_len is not None and keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is greater than the model's context length "
                                  f"({max_model_len}): choose a smaller truncation", param="truncate_prompt_tokens")
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's output budget, as vLLM (0.32) sets it: ``max_tokens`` (None: no cap) capped at what the context
    leaves after the prompt, where the request then ends with ``finish_reason`` "length". ``InvalidRequestError``
    when the prompt leaves no room, or ``max_tokens`` alone is more than the context holds."""
    n, limit = num_prompt_tokens, max_model_len
    if n >= limit:
        raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                  f"{n} tokens, which leaves no room for the completion. Please reduce the length "
                                  f"of the prompt.", param="prompt")
    if max_tokens is not None and max_tokens > limit:
        raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                                  f"{max_tokens} tokens for the completion alone. Please reduce max_tokens.",
                                  param="max_tokens")
    return limit - n if max_tokens is None else min(max_tokens, limit - n)



def block_hashes(token_ids: Sequence[int], fingerprint: ModelFingerprint, cache_salt: str | None = None,
                 memo: BlockHashMemo | None = None, shared: tuple | None = None) -> list[BlockHash]:
    """The engines' prefix-cache hashes of every full block of ``token_ids``; with a ``memo`` and ``shared`` (from
    ``Frontend.encode_prompt_chunked``) the shared prefix's hashes come from the memo."""
    root = root_hash(fingerprint, cache_salt)
    if memo is not None:
        return memo.hashes(token_ids, fingerprint.block_size, root, shared)
    return hash_prompt_blocks(token_ids, fingerprint.block_size, root)


class Frontend:
    """Turns requests into validated token ids and block hashes; see the module docstring."""

    def __init__(self, files: ModelFiles, tokenizer: Tokenizer, token_cache_chunks: int = 0) -> None:
        """``token_cache_chunks`` > 0: prompt text goes through a ``TokenChunkCache`` of that many chunks (the
        router's choice; one thread only)."""
        self.files = files
        self.tokenizer = tokenizer
        self.vocab_size = files.vocab_size
        self.eos_token_ids = files.eos_token_ids
        self.token_cache = TokenChunkCache(tokenizer, token_cache_chunks) if token_cache_chunks > 0 else None
        self.hash_memo = BlockHashMemo(token_cache_chunks) if self.token_cache is not None else None
        self._encode_text = self.token_cache.encode if self.token_cache is not None else tokenizer.encode
        # Structured output's compiler (``pdpool.engine.structured.Grammars``), set by the engines that generate
        # (``AsyncLLM``, ``LLM``); a router only parses the constraint.
        self.grammars = None

    @classmethod
    def from_model(cls, model: str, token_cache_chunks: int = 0, chat_template: str | None = None) -> "Frontend":
        """``model``: 'demo' or a local folder (never downloaded); ``chat_template``: ``--chat-template``'s value."""
        from pdpool.models.demo import resolve_model

        path = resolve_model(model)
        return cls(ModelFiles.read(path), Tokenizer(path, chat_template), token_cache_chunks)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
        """The chat template (the model's, or the request's ``chat_template``) applied to ``messages``; raises
        ``InvalidRequestError`` when it fails, naming ``chat_template`` when it was the request's, else
        ``messages``."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message, tools,
                                                      chat_template, template_kwargs)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the client's message list or template
            raise InvalidRequestError(f"cannot apply the chat template: {exc}",
                                      param="chat_template" if chat_template else "messages") from None

    def encode_prompt_json(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                           ) -> tuple[list[int], bytes | None]:
        """``encode_prompt`` plus the ids' JSON where the token cache makes it cheaply (else None)."""
        ids, ids_json, _ = self.encode_prompt_chunked(prompt, add_special_tokens)
        return ids, ids_json

    def encode_prompt_chunked(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                              ) -> tuple[list[int], bytes | None, tuple | None]:
        """``encode_prompt_json`` plus the prompt's shared chunks for ``block_hashes`` (None where there are
        none: ids, or no token cache)."""
        if isinstance(prompt, str) and self.token_cache is not None:
            ids, ids_json, shared = self.token_cache.encode_chunked(prompt, add_special_tokens)
            if not ids:
                raise InvalidRequestError("the prompt is empty")
            return ids, ids_json, shared
        return self.encode_prompt(prompt, add_special_tokens), None, None

    def encode_prompt(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (text, or ids checked against the vocabulary); raises ``InvalidRequestError``."""
        if isinstance(prompt, str):
            ids = self._encode_text(prompt, add_special_tokens)
        else:
            ids = list(prompt)
            check_token_ids(ids, self.vocab_size, "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def apply_prompt_options(self, ids: list[int], params, max_model_len: int) -> list[int]:
        """A request's options that need the tokenizer or cut its prompt, before the engine takes it: fills
        ``params.bad_words_token_ids`` from ``bad_words``; returns the ids ``truncate_prompt_tokens`` keeps (``ids``
        itself when nothing is cut); compiles ``structured_outputs`` into ``params.grammar``. Raises
        ``InvalidRequestError``."""
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None and params.grammar is None:
            if self.grammars is None:
                raise InvalidRequestError("structured output is not available here (no grammar compiler)",
                                          param=params.structured_outputs.param)
            params.grammar = self.grammars.compile(params.structured_outputs)
        return truncate_prompt(ids, params.truncate_prompt_tokens, max_model_len)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """vLLM's token ids of ``bad_words``: each word as written (leading spaces stripped) and, when it differs
        only in its first token and not in length, with one leading space (the word inside a sentence). A word
        that is no token at all is an ``InvalidRequestError``."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise InvalidRequestError(f"bad_words entry {word!r} has no tokens", param="bad_words")
            out.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                out.append(spaced)
        return out

    def block_hashes(self, token_ids: Sequence[int], fingerprint: ModelFingerprint, cache_salt: str | None = None,
                     shared: tuple | None = None) -> list[BlockHash]:
        """The engines' prefix-cache hashes of every full block of ``token_ids``; with ``shared`` (from
        ``encode_prompt_chunked``) the shared prefix's hashes come from the memo."""
        return block_hashes(token_ids, fingerprint, cache_salt, self.hash_memo, shared)
