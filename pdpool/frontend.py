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
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Sequence

from pdpool.block_hash import BlockHash, ModelFingerprint, extend_block_hashes, hash_prompt_blocks, root_hash


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


# transformers' marker of where the final message's content ends (continue_final_message)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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


class PieceEncoder:
    """Token ids of text without special tokens, through the byte-level pre-tokenizer's pieces, each piece's ids
    cached: the router's fresh prompt text (a new question after a cached system prompt) costs a regex split and
    dict lookups instead of a full ``tokenizers`` pass, whose pre-tokenization alone took most of its 0.3 ms for
    1,500 characters on the benchmark machine (docs/performance.md).

    Only for the tokenizers ``TokenChunkCache.cacheable`` accepts (the same argument holds: BPE runs within
    pieces). The text is first split around the added tokens, longest match first, as ``tokenizers`` does; each
    ASCII segment in between is cut into pieces by the GPT-2 pattern on ASCII (in C where the router's piece table
    builds, ``pdpool/csrc/pieces.c``, which also writes the ids' JSON; else ``re``), and a non-ASCII segment goes
    to ``tokenizers`` whole. A piece not seen yet goes to the BPE model alone, as its UTF-8 bytes mapped to the
    byte-level alphabet (GPT-2's ``bytes_to_unicode``). The constructor checks the whole path against the
    tokenizer on a probe of every byte and raises ``ValueError`` if they differ (the C table is dropped, with a
    warning, if it alone differs); property tests check it on any Unicode text
    (``tests/router/test_token_cache.py``). The cache is cleared when it reaches ``capacity`` pieces.
    """

    PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    # The same pattern on ASCII text (letters [A-Za-z], digits [0-9], White_Space \t\n\v\f\r and space), for
    # the standard library's ``re``: 0.10 -> 0.04 ms for a 1,800-character question (docs/performance.md).
    _WS = "\t\n\x0b\x0c\r "
    ASCII_PATTERN = rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"""
    ASCII_PROBE = "".join(chr(c) for c in range(128)) + " Hello  world's 42 x\t\n\n  it'll 3.14 --x  \x1c\x1f y "
    PROBE = "".join(chr(c) for c in range(1, 0x800)) + " Hello  world's 42 日本 🙂\u3000x\xa0\n\n"

    def __init__(self, tokenizer: "Tokenizer", capacity: int = 200_000, native: bool = True) -> None:
        import regex

        raw = tokenizer._tok
        self._encode_raw = raw.encode
        # The BPE model's ids of one piece, for the C table's misses: a function of the tokenizer alone. A bound
        # method would hold this encoder from inside the table it holds, a cycle that the collector cannot see
        # (the C table is not tracked) and so never frees: 25 MB of table per encoder, whose pages a fork must
        # still be able to commit (a test process that made hundreds of encoders could no longer fork).
        self._bpe = partial(_bpe_ids, raw.model.tokenize, _byte_level_alphabet())
        self._pieces = regex.compile(self.PATTERN)
        ascii_pieces = re.compile(self.ASCII_PATTERN)
        self._ascii_pieces = (ascii_pieces if ascii_pieces.findall(self.ASCII_PROBE)
                              == self._pieces.findall(self.ASCII_PROBE) else self._pieces)
        self._added_ids = {t.content: i for i, t in raw.get_added_tokens_decoder().items()}
        names = sorted(self._added_ids, key=len, reverse=True)
        self._added = regex.compile("|".join(regex.escape(n) for n in names)) if names else None
        # A text without the one character every added token starts with (e.g. '<') holds none of them: a
        # substring test instead of the regex's search (0.07 against 0.58 us for a 256-character chunk)
        firsts = {n[:1] for n in names}
        self._added_first = firsts.pop() if len(firsts) == 1 and "" not in firsts else None
        self._cache: dict[str, list[int]] = {}
        self.capacity = capacity
        # ASCII segments in C where it builds (pdpool/csrc/pieces.c: the ASCII pattern's cuts, a piece table and
        # the ids' JSON in one pass); checked on the probe against this class's Python path, else not used.
        self._table = None
        table = _native_piece_table(self._bpe, capacity) if native else None
        probe = self.PROBE + "".join(names)
        expected = raw.encode(probe, add_special_tokens=False).ids
        if self.encode(probe) != expected:
            raise ValueError("the piece encoder disagrees with the tokenizer")
        if table is not None:
            self._table = table
            ids, ids_json = self.encode_entry(self.ASCII_PROBE)
            if (ids != raw.encode(self.ASCII_PROBE, add_special_tokens=False).ids or self.encode(probe) != expected
                    or ids_json != ",".join(map(str, ids)).encode()):
                self._table = None
                logging.getLogger("pdpool.router").warning("the native piece table disagrees with the tokenizer;"
                                                           " not used")
            table.clear()
        self._cache.clear()

    @property
    def native(self) -> bool:
        return self._table is not None

    def encode_entry(self, text: str) -> tuple | list:
        """``(ids, their JSON without brackets)`` when the native table did the whole text (ASCII, no added
        token) in one pass, else ``[ids, None]`` (the JSON is then made when it is needed)."""
        table = self._table
        added, first = self._added, self._added_first
        if table is not None and text.isascii() and (added is None or (first is not None and first not in text)
                                                     or added.search(text) is None):
            return table.encode(text)
        return [self.encode(text), None]

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
        if not segment.isascii():
            # The tokenizer itself: ``regex`` and the tokenizer's Oniguruma may classify a code point differently
            # (Unicode versions differ: U+3D000 is a letter to one and not the other, so "\U0003d000's" split
            # differently), so a piece split of non-ASCII text is not proven equal.
            ids.extend(self._encode_raw(segment, add_special_tokens=False).ids)
            return
        if self._table is not None:
            if segment:
                ids.extend(self._table.encode(segment)[0])
            return
        cache = self._cache
        for piece in self._ascii_pieces.findall(segment):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._bpe(piece)
                if len(cache) >= self.capacity:
                    cache.clear()
                cache[piece] = piece_ids
            ids.extend(piece_ids)


def _bpe_ids(tokenize, chars: list[str], piece: str) -> list[int]:
    """The BPE model's ids of one pre-tokenizer piece: its UTF-8 bytes as the byte-level alphabet's characters."""
    return [t.id for t in tokenize("".join([chars[b] for b in piece.encode()]))]


def _native_piece_table(miss, capacity: int):
    from pdpool import native_text as native   # the router's C piece table, built on first use; None where it cannot be

    module = native.load()
    return module.PieceTable(miss, capacity) if module is not None else None


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

    def __init__(self, tokenizer: "Tokenizer", capacity: int = 8192, chunk_chars: int = 256,
                 native: bool = True) -> None:
        """``native=False``: the chunk loop in Python even where the C one is (the tests compare them)."""
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.chunk_chars = max(1, chunk_chars)
        self._lru: OrderedDict[str, list] = OrderedDict()   # chunk text -> [ids, their JSON or None]
        self.enabled = self.cacheable(tokenizer)
        self.special_prefix = self._special_prefix() if self.enabled else None
        self.pieces = _piece_encoder(tokenizer) if self.enabled else None
        self._native_chunks = _native_function("chunks") if self.pieces is not None and self.pieces.native else None
        # The chunk loop in C (pdpool/csrc/pieces.c's ChunkLRU: the same LRU order and results as the loop below,
        # tests/router/test_token_cache.py), where the native module loads; then ``_lru`` stays empty.
        # (no reference back to self: the C LRU is not tracked by the garbage collector)
        self._encode_fresh = (self.pieces.encode_entry if self.pieces is not None
                              else partial(_encode_whole, tokenizer))
        lru_type = _native_function("ChunkLRU") if self.enabled and native else None
        self._native_lru = (lru_type(min(max(0, capacity), 1 << 30), self._encode_fresh) if lru_type is not None
                            else None)
        self._special_json = (json.dumps(self.special_prefix, separators=(",", ":")).encode()[1:-1]
                              if self.special_prefix else None)
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
        if self._native_chunks is not None:   # the same cuts in C (pdpool/csrc/pieces.c; a test compares them)
            return self._native_chunks(text, self.chunk_chars)
        return self.chunks_re(text)

    def chunks_re(self, text: str) -> list[str]:
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
        return self.encode_chunked(text, add_special_tokens)[0]

    def encode_with_json(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], bytes]:
        """The ids and ``json.dumps(ids, separators=(",", ":"))``, encoded: the router forwards the ids as JSON,
        and a cached chunk's JSON is written once, not once per request that shares it."""
        ids, ids_json, _ = self.encode_chunked(text, add_special_tokens)
        return ids, ids_json

    def encode_chunked(self, text: str, add_special_tokens: bool = True
                       ) -> tuple[list[int], bytes, tuple[int, tuple[tuple[str, int], ...]] | None]:
        """``encode_with_json`` plus the text's leading chunks that were cached already: ``(ids before the first
        chunk, ((chunk text, ids up to its end), ...))``, what ``BlockHashMemo`` keeps shared prefixes' block
        hashes by; None when the text is encoded whole.

        One pass over the chunks: each is looked up in the LRU, a missing one is encoded (``PieceEncoder``, else
        ``tokenizers``) and added; the ids and the JSON parts are joined as they come."""
        if not self.enabled or len(text) < 2 * self.chunk_chars or (add_special_tokens and
                                                                    self.special_prefix is None):
            ids = self.tokenizer.encode(text, add_special_tokens)
            return ids, json.dumps(ids, separators=(",", ":")).encode(), None
        ids = list(self.special_prefix) if add_special_tokens else []
        lead = len(ids)
        if self._native_lru is not None:   # the loop below, in C
            ids, ids_json, cached, hits, misses = self._native_lru.run(self.chunks(text), ids,
                                                                        self._special_json if ids else None)
            self.hit_chunks += hits
            self.missed_chunks += misses
            return ids, ids_json, (lead, cached)
        parts = [self._special_json] if ids else []
        shared = []
        lru = self._lru
        get, move_to_end = lru.get, lru.move_to_end
        encode_fresh = self._encode_fresh
        in_prefix = True                  # the shared prefix ends at the first chunk not cached
        for chunk in self.chunks(text):
            entry = get(chunk)
            if entry is None:
                entry = lru[chunk] = encode_fresh(chunk)
                if len(lru) > self.capacity:
                    lru.popitem(last=False)
                self.missed_chunks += 1
                in_prefix = False
            else:
                move_to_end(chunk)
                self.hit_chunks += 1
            ids.extend(entry[0])
            if in_prefix:
                shared.append((chunk, len(ids)))
            if entry[1] is None:   # ids are ints: str() is their JSON (2 µs less per chunk than json.dumps)
                entry[1] = ",".join(map(str, entry[0])).encode()
            if entry[1]:
                parts.append(entry[1])
        return ids, b"[" + b",".join(parts) + b"]", (lead, tuple(shared))


def _encode_whole(tokenizer: "Tokenizer", chunk: str) -> list:
    return [tokenizer.encode(chunk, False), None]


class BlockHashMemo:
    """Block hashes of shared prompt prefixes, kept by token-cache chunk sequence, so that a request hashes only
    the blocks after its shared prefix (its own question), not the whole prompt again.

    A trie per (root hash, ids before the first chunk), one level per chunk, keyed by the chunk's text; the node
    for chunks ``c0 .. cj`` keeps the hashes of the blocks that end within ``cj`` (blocks ``[e(j-1) // B,
    e(j) // B)``, ``e`` = ids up to a chunk's end). Those depend only on the root and the ids up to ``cj``'s end,
    which are a function of the chunk texts (a chunk's ids do not depend on its neighbours: ``TokenChunkCache``),
    so the memo gives bit for bit what ``hash_prompt_blocks`` gives (a property test checks it). Only chunks that
    were in the token cache before the request are added (a shared prefix, not a request's fresh question). Emptied
    when it holds ``capacity`` nodes. One thread only.
    """

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._tries: dict[tuple, dict] = {}
        self._nodes = 0

    def hashes(self, token_ids: Sequence[int], block_size: int, root: BlockHash,
               shared: tuple[int, tuple[tuple[str, int], ...]] | None) -> list[BlockHash]:
        """``hash_prompt_blocks(token_ids, block_size, root)``; ``shared``: the prompt's leading cached chunks as
        ``TokenChunkCache.encode_chunked`` gives them (ids before the first chunk; each chunk's text and the
        ids up to its end)."""
        if not shared or not shared[1]:
            return extend_block_hashes([], token_ids, block_size, root)
        lead, chunks = shared
        key = (root, block_size, tuple(token_ids[:lead]))
        hashes: list[BlockHash] = []
        kids = self._tries.get(key)
        depth = 0
        if kids is not None:
            for text, _ in chunks:
                node = kids.get(text)
                if node is None:
                    break
                hashes.extend(node[1])
                kids = node[0]
                depth += 1
        extend_block_hashes(hashes, token_ids, block_size, root)
        if depth < len(chunks):
            if self._nodes + len(chunks) - depth > self.capacity:
                self._tries.clear()
                self._nodes, depth = 0, 0
            if depth == 0:
                kids = self._tries.setdefault(key, {})
            done = chunks[depth - 1][1] // block_size if depth else 0
            for text, end in chunks[depth:]:
                node = kids[text] = [{}, hashes[done:end // block_size]]
                kids = node[0]
                done = end // block_size
            self._nodes += len(chunks) - depth
        return hashes


def _native_function(name: str):
    """A function of the router's native module (``pdpool/csrc/pieces.c``), or None where it cannot be built."""
    from pdpool import native_text as native

    module = native.load()
    return getattr(module, name) if module is not None else None


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
    def from_model(cls, model: str, token_cache_chunks: int = 0) -> "Frontend":
        """``model``: 'demo' or a local folder (never downloaded)."""
        from pdpool.models.demo import resolve_model

        path = resolve_model(model)
        return cls(ModelFiles.read(path), Tokenizer(path), token_cache_chunks)

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
