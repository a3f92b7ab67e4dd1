"""The router's token and block-hash caches, for the request front end (``pdpool.frontend``): prompt text to token
ids by chunks and by pre-tokenizer pieces, each cached (``TokenChunkCache``, ``PieceEncoder``), with the ids' JSON
made on the way, and the block hashes of shared prompt prefixes kept by chunk (``BlockHashMemo``). Each gives bit
for bit what the plain path gives (the tokenizer, ``hash_prompt_blocks``): property tests in
``tests/router/test_token_cache.py`` check it. One thread only; the router builds them (``Frontend``'s
``token_cache_chunks``), a node does not. ``tokenizer`` is always a ``pdpool.frontend.Tokenizer`` (not imported
here: the front end imports this module).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from functools import partial
from typing import Sequence

from pdpool.block_hash import BlockHash, extend_block_hashes


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

    def __init__(self, tokenizer, capacity: int = 200_000, native: bool = True) -> None:
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

    def __init__(self, tokenizer, capacity: int = 8192, chunk_chars: int = 256,
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
    def cacheable(tokenizer) -> bool:
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


def _encode_whole(tokenizer, chunk: str) -> list:
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


def _piece_encoder(tokenizer) -> PieceEncoder | None:
    try:
        return PieceEncoder(tokenizer)
    except (ImportError, ValueError, AttributeError):   # no ``regex``, or not GPT-2's byte level: whole chunks
        return None
