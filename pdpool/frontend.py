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
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Sequence

from pdpool.block_hash import BlockHash, ModelFingerprint, hash_prompt_blocks, root_hash


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
        return cls(path, vocab, tuple(eos))


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


class Tokenizer:
    """A Hugging Face fast tokenizer read with ``tokenizers``: encode, decode, and the chat template."""

    SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        self._tok = _Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json") or {}
        self.special_tokens = {name: _token_text(config.get(name)) for name in self.SPECIAL_NAMES}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(path, config)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(t) for t in token_ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                     documents=None, **{k: v for k, v in self.special_tokens.items() if v})

    @cached_property
    def _template(self):
        if self.chat_template is None:
            return None
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
        return env.from_string(self.chat_template)


class PieceEncoder:
    """Token ids of text without special tokens, through the byte-level pre-tokenizer's pieces, each piece's ids
    cached: the router's fresh prompt text (a new question after a cached system prompt) costs a regex split and
    dict lookups instead of a full ``tokenizers`` pass, whose pre-tokenization alone took most of its 0.3 ms for
    1,500 characters on the benchmark machine (docs/performance.md).

    Only for the tokenizers ``TokenChunkCache.cacheable`` accepts (the same argument holds: BPE runs within
    pieces). The text is first split around the added tokens, longest match first, as ``tokenizers`` does; each
    segment in between is cut into pieces by the GPT-2 pattern (the ``regex`` module, a dependency of
    transformers). A piece not seen yet goes to the BPE model alone, as its UTF-8 bytes mapped to the byte-level
    alphabet (GPT-2's ``bytes_to_unicode``), so a text of new words costs about what ``tokenizers`` does. The
    constructor checks the whole path against the tokenizer on a probe of every byte and raises ``ValueError``
    if they differ; a property test checks it on any Unicode text (``tests/router/test_token_cache.py``). The
    cache is cleared when it reaches ``capacity`` pieces.
    """

    PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    # The same pattern on ASCII text (letters [A-Za-z], digits [0-9], White_Space \t\n\v\f\r and space), for
    # the standard library's ``re``: 0.10 -> 0.04 ms for a 1,800-character question (docs/performance.md).
    _WS = "\t\n\x0b\x0c\r "
    ASCII_PATTERN = rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"""
    ASCII_PROBE = "".join(chr(c) for c in range(128)) + " Hello  world's 42 x\t\n\n  it'll 3.14 --x  \x1c\x1f y "
    PROBE = "".join(chr(c) for c in range(1, 0x800)) + " Hello  world's 42 日本 🙂\u3000x\xa0\n\n"

    def __init__(self, tokenizer: "Tokenizer", capacity: int = 200_000) -> None:
        import regex

        raw = tokenizer._tok
        self._tokenize = raw.model.tokenize
        self._byte_chars = _byte_level_alphabet()
        self._pieces = regex.compile(self.PATTERN)
        ascii_pieces = re.compile(self.ASCII_PATTERN)
        self._ascii_pieces = (ascii_pieces if ascii_pieces.findall(self.ASCII_PROBE)
                              == self._pieces.findall(self.ASCII_PROBE) else self._pieces)
        self._added_ids = {t.content: i for i, t in raw.get_added_tokens_decoder().items()}
        names = sorted(self._added_ids, key=len, reverse=True)
        self._added = regex.compile("|".join(regex.escape(n) for n in names)) if names else None
        self._cache: dict[str, list[int]] = {}
        self.capacity = capacity
        probe = self.PROBE + "".join(names)
        if self.encode(probe) != raw.encode(probe, add_special_tokens=False).ids:
            raise ValueError("the piece encoder disagrees with the tokenizer")
        self._cache.clear()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        if self._added is None:
            self._encode_segment(text, ids)
            return ids
        pos = 0
        for m in self._added.finditer(text):
            self._encode_segment(text[pos:m.start()], ids)
            ids.append(self._added_ids[m.group()])
            pos = m.end()
        self._encode_segment(text[pos:], ids)
        return ids

    def _encode_segment(self, segment: str, ids: list[int]) -> None:
        cache = self._cache
        for piece in (self._ascii_pieces if segment.isascii() else self._pieces).findall(segment):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                chars = self._byte_chars
                piece_ids = [t.id for t in self._tokenize("".join([chars[b] for b in piece.encode()]))]
                if len(cache) >= self.capacity:
                    cache.clear()
                cache[piece] = piece_ids
            ids.extend(piece_ids)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's ``bytes_to_unicode``: byte -> the printable character the byte-level BPE vocabulary spells it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class TokenChunkCache:
    """Token ids of long prompts, tokenized chunk by chunk and cached per chunk: a system prompt or document that
    many requests share is tokenized once, and only each request's own tail after that.

    The text is cut into chunks of about ``chunk_chars`` characters, each cut right before a space whose
    preceding character is not whitespace. The cuts depend only on the text before them (plus one character), so
    requests sharing a prefix share its chunks; the LRU is keyed by the chunk text itself.

    Why a chunk's ids do not depend on its neighbours, for the tokenizers it accepts (``cacheable``): no
    normalizer; added tokens without whitespace and without lstrip/rstrip (so none spans a cut, and the text is
    split around them the same way); the GPT-2 byte-level pre-tokenizer, whose pieces are
    ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``. A piece holding a
    non-whitespace character holds no whitespace after it, so the piece ending at the cut's left neighbour ends
    at the cut whatever follows, and without lookbehind the pieces from the cut on depend only on the text from
    the cut on. BPE runs within pieces, so ``encode(a + b) == encode(a) + encode(b)``. A hypothesis test checks
    it against the real tokenizer (``tests/router/test_token_cache.py``). Other tokenizers are encoded whole.

    One thread only (the router's event loop): the LRU is not locked.
    """

    CUT = re.compile(r"(?<=\S) ")

    def __init__(self, tokenizer: "Tokenizer", capacity: int = 8192, chunk_chars: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.chunk_chars = max(1, chunk_chars)
        raw = tokenizer._tok
        self._encode_batch = getattr(raw, "encode_batch_fast", raw.encode_batch)
        self._lru: OrderedDict[str, list] = OrderedDict()   # chunk text -> [ids, their JSON or None]
        self.enabled = self.cacheable(tokenizer)
        self.special_prefix = self._special_prefix() if self.enabled else None
        self.pieces = _piece_encoder(tokenizer) if self.enabled else None
        self.hit_chunks = 0
        self.missed_chunks = 0

    @staticmethod
    def cacheable(tokenizer: "Tokenizer") -> bool:
        raw = tokenizer._tok
        try:
            pre = json.loads(raw.pre_tokenizer.__getstate__()) if raw.pre_tokenizer is not None else {}
        except (AttributeError, TypeError, ValueError):
            return False
        if raw.normalizer is not None or pre != {"type": "ByteLevel", "add_prefix_space": False,
                                                 "trim_offsets": pre.get("trim_offsets"), "use_regex": True}:
            return False
        for added in raw.get_added_tokens_decoder().values():
            if added.lstrip or added.rstrip or added.single_word or any(c.isspace() for c in added.content):
                return False
        return True

    def _special_prefix(self) -> list[int] | None:
        """What ``add_special_tokens`` puts before the text (e.g. a BOS), or None when it adds anything after it."""
        probes = ("hello world", "The sky is blue.")
        plain = [self.tokenizer.encode(p, False) for p in probes]
        special = [self.tokenizer.encode(p, True) for p in probes]
        prefix = special[0][:len(special[0]) - len(plain[0])]
        ok = all(s == prefix + p for s, p in zip(special, plain))
        return prefix if ok else None

    def chunks(self, text: str) -> list[str]:
        cuts = [0]
        pos = self.chunk_chars
        while pos < len(text):
            m = self.CUT.search(text, pos)
            if m is None:
                break
            cuts.append(m.start())
            pos = m.start() + self.chunk_chars
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        entries = self._entries(text, add_special_tokens)
        if entries is None:
            return self.tokenizer.encode(text, add_special_tokens)
        ids = list(self.special_prefix) if add_special_tokens else []
        for entry in entries:
            ids.extend(entry[0])
        return ids

    def encode_with_json(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], bytes]:
        """The ids and ``json.dumps(ids, separators=(",", ":"))``, encoded: the router forwards the ids as JSON,
        and a cached chunk's JSON is written once, not once per request that shares it."""
        entries = self._entries(text, add_special_tokens)
        if entries is None:
            ids = self.tokenizer.encode(text, add_special_tokens)
            return ids, json.dumps(ids, separators=(",", ":")).encode()
        ids = list(self.special_prefix) if add_special_tokens else []
        parts = [json.dumps(ids, separators=(",", ":")).encode()[1:-1]] if ids else []
        for entry in entries:
            ids.extend(entry[0])
            if entry[1] is None:   # ids are ints: str() is their JSON (2 µs less per chunk than json.dumps)
                entry[1] = ",".join(map(str, entry[0])).encode()
            if entry[1]:
                parts.append(entry[1])
        return ids, b"[" + b",".join(parts) + b"]"

    def _entries(self, text: str, add_special_tokens: bool) -> list[list] | None:
        """The LRU entries ``[ids, JSON of the ids or None]`` of the text's chunks, in order; None when the text is
        to be encoded whole."""
        if not self.enabled or len(text) < 2 * self.chunk_chars or (add_special_tokens and
                                                                    self.special_prefix is None):
            return None
        pieces = self.chunks(text)
        lru = self._lru
        found = [lru.get(p) for p in pieces]
        missing = list(dict.fromkeys(p for p, entry in zip(pieces, found) if entry is None))
        fresh = {}
        if missing:
            if self.pieces is not None:
                fresh = {p: self.pieces.encode(p) for p in missing}
            else:
                fresh = {p: e.ids for p, e in zip(missing, self._encode_batch(missing, add_special_tokens=False))}
            self.missed_chunks += len(missing)
        entries = []
        for piece, entry in zip(pieces, found):
            if entry is None:
                entry = lru.get(piece)   # an earlier copy of this chunk in the same text
                if entry is None:
                    entry = lru[piece] = [fresh[piece], None]
                    if len(lru) > self.capacity:
                        lru.popitem(last=False)
            else:
                self.hit_chunks += 1
                try:
                    lru.move_to_end(piece)
                except KeyError:   # evicted by this text's own new chunks (a text longer than the cache)
                    pass
            entries.append(entry)
        return entries


def _piece_encoder(tokenizer: "Tokenizer") -> PieceEncoder | None:
    try:
        return PieceEncoder(tokenizer)
    except (ImportError, ValueError, AttributeError):   # no ``regex``, or not GPT-2's byte level: whole chunks
        return None


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


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's output budget: ``max_tokens``, or what the context leaves when it is None. Raises
    ``InvalidRequestError`` when the prompt and the completion do not fit in ``max_model_len``."""
    n, limit = num_prompt_tokens, max_model_len
    if max_tokens is None:
        if n >= limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                              f"has {n} tokens, which leaves no room for the completion.")
        return limit - n
    if n + max_tokens > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or max_tokens.",
            param="prompt" if n >= limit else "max_tokens")
    return max_tokens


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
        self._encode_text = self.token_cache.encode if self.token_cache is not None else tokenizer.encode

    @classmethod
    def from_model(cls, model: str, token_cache_chunks: int = 0) -> "Frontend":
        """``model``: 'demo' or a local folder (never downloaded)."""
        from pdpool.models.demo import resolve_model

        path = resolve_model(model)
        return cls(ModelFiles.read(path), Tokenizer(path), token_cache_chunks)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``; raises ``InvalidRequestError`` (param ``messages``) when it fails."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's message list
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None

    def encode_prompt_json(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                           ) -> tuple[list[int], bytes | None]:
        """``encode_prompt`` plus the ids' JSON where the token cache makes it cheaply (else None)."""
        if isinstance(prompt, str) and self.token_cache is not None:
            ids, ids_json = self.token_cache.encode_with_json(prompt, add_special_tokens)
            if not ids:
                raise InvalidRequestError("the prompt is empty")
            return ids, ids_json
        return self.encode_prompt(prompt, add_special_tokens), None

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

    @staticmethod
    def block_hashes(token_ids: Sequence[int], fingerprint: ModelFingerprint,
                     cache_salt: str | None = None) -> list[BlockHash]:
        """The engines' prefix-cache hashes of every full block of ``token_ids``."""
        return hash_prompt_blocks(token_ids, fingerprint.block_size, root_hash(fingerprint, cache_salt))
