"""The router's per-chunk token cache must give exactly the token ids of whole-text tokenization (the engines
hash the ids the router forwards): property tests against the demo model's real tokenizer."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pdpool.frontend import Frontend
from pdpool.token_cache import BlockHashMemo, PieceEncoder, TokenChunkCache

# Fragments chosen to stress the pre-tokenizer's pieces: runs of spaces, other whitespace (Unicode too), the
# contractions, digits, punctuation runs, non-Latin letters, emoji, and the tokenizer's added tokens.
FRAGMENTS = ["a", "b", "Hello", "world", "é", "ß", "日本", "中", "🙂", "7", "42", "0.5", " ", "  ", "   ", "\n", "\n\n",
             "\t", "\r\n", "\xa0", "\u3000", "\u2028", "\x85", "\x1c", "\u200b", "'", "'s", "'ll", "n't", ".", ",",
             "!?", "...", "-", "(", ")", '"', "<|im_start|>", "<|im_end|>", "<|endoftext|>", "system", "user"]
texts = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=120).map("".join)


@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    return Frontend.from_model("demo")


@pytest.fixture(scope="module")
def tiny_chunks(frontend):
    """Chunks of a few characters, so every example is cut many times; one cache across examples (warm hits)."""
    cache = TokenChunkCache(frontend.tokenizer, capacity=64, chunk_chars=3)
    assert cache.enabled and cache.special_prefix is not None
    return cache


@settings(max_examples=400, deadline=None)
@given(text=texts, add_special=st.booleans())
def test_chunked_equals_whole_text_tokenization(tiny_chunks, text, add_special):
    expected = tiny_chunks.tokenizer.encode(text, add_special)
    assert tiny_chunks.encode(text, add_special) == expected
    assert tiny_chunks.encode(text, add_special) == expected  # again, now from the cache


@settings(max_examples=300, deadline=None)
@given(text=texts, add_special=st.booleans())
def test_the_ids_json_is_json_dumps_of_the_ids(tiny_chunks, text, add_special):
    """The router forwards these bytes as the token ids: cached chunks' JSON, joined, must be the ids' JSON."""
    expected = tiny_chunks.tokenizer.encode(text, add_special)
    for _ in range(2):  # cold, then from the cache
        ids, ids_json = tiny_chunks.encode_with_json(text, add_special)
        assert ids == expected and ids_json == json.dumps(expected, separators=(",", ":")).encode()


@settings(max_examples=400, deadline=None)
@given(text=texts | st.text(max_size=60) | st.lists(texts | st.text(max_size=8), max_size=6).map("".join))
def test_the_piece_encoder_is_whole_text_tokenization(frontend, text):
    """Fresh chunks are encoded piece by piece (the pre-tokenizer's pieces, cached): the same ids as the real
    tokenizer on the whole text, for the stress fragments and for any Unicode text."""
    pieces = PieceEncoder(frontend.tokenizer, capacity=50)
    expected = frontend.tokenizer.encode(text, False)
    assert pieces.encode(text) == expected
    assert pieces.encode(text) == expected  # from the piece cache


ascii_texts = st.text(alphabet=st.characters(max_codepoint=127), max_size=80) | st.lists(st.sampled_from(
    [f for f in FRAGMENTS if f.isascii()] + ["\x0b", "\x0c", "\x1f", "\x7f", "I'M", "it's", "  x"]),
    max_size=60).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=ascii_texts)
def test_the_ascii_pattern_cuts_ascii_text_as_the_unicode_pattern_does(frontend, text):
    """ASCII segments are cut by the standard library's ``re`` (faster); the same pieces as the ``regex`` pattern,
    hence the same ids as the tokenizer (every ASCII string of 3 characters was also checked once, by hand)."""
    pieces = PieceEncoder(frontend.tokenizer, capacity=50)
    assert pieces._ascii_pieces is not pieces._pieces     # the start-up probe accepted the ASCII pattern
    assert pieces._ascii_pieces.findall(text) == pieces._pieces.findall(text)
    assert pieces.encode(text) == frontend.tokenizer.encode(text, False)


@settings(max_examples=200, deadline=None)
@given(text=texts, size=st.integers(1, 12))
def test_cuts_are_before_a_space_after_non_whitespace(frontend, text, size):
    chunks = TokenChunkCache(frontend.tokenizer, chunk_chars=size).chunks(text)
    assert "".join(chunks) == text
    for left, right in zip(chunks, chunks[1:]):
        assert right.startswith(" ") and left and not left[-1].isspace()


@pytest.fixture(scope="module")
def cached_frontend(frontend):
    cached = Frontend(frontend.files, frontend.tokenizer, token_cache_chunks=256)
    cached.token_cache.chunk_chars = 8
    return cached


@settings(max_examples=100, deadline=None)
@given(system=texts, question=texts)
def test_chat_prompts_sharing_a_system_prompt(frontend, cached_frontend, system, question):
    cached = cached_frontend
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = frontend.render_chat(messages)
    assert cached.encode_prompt(text, False) == frontend.encode_prompt(text, False)


def test_a_shared_system_prompt_is_tokenized_once(frontend):
    cached = Frontend.from_model("demo", token_cache_chunks=1024)
    system = "You are a careful assistant. " * 60
    prompts = [frontend.render_chat([{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}: what is {i} squared?"}])
               for i in range(5)]
    for text in prompts:
        assert cached.encode_prompt(text, False) == frontend.encode_prompt(text, False)
    cache = cached.token_cache
    per_prompt = len(cache.chunks(prompts[0]))
    assert cache.hit_chunks >= 4 * (per_prompt - 2)  # only the tail chunks of prompts 2..5 were tokenized


def test_short_texts_and_unknown_tokenizers_are_encoded_whole(frontend):
    cache = TokenChunkCache(frontend.tokenizer, chunk_chars=256)
    assert cache.encode("short", True) == frontend.tokenizer.encode("short", True)
    assert cache.missed_chunks == 0 and cache.hit_chunks == 0


# ---- the native piece table (pdpool/csrc/pieces.c) and the block-hash memo -------------------------------------

def test_the_native_piece_table_builds_and_is_used(frontend):
    """CI and the image have a C compiler and Python's headers: the router's fast path must be there, not a
    silent fallback."""
    from pdpool import native_text as native

    assert native.load() is not None
    assert PieceEncoder(frontend.tokenizer).native
    assert not PieceEncoder(frontend.tokenizer, native=False).native


@contextlib.contextmanager
def hash_loop(native: bool):
    """``pdpool.block_hash``'s loop in C (``native``) or in hashlib, for the duration of a ``with``."""
    from pdpool import block_hash, native_text

    saved = list(block_hash._chain)
    block_hash._chain[:] = [native_text.load().hash_chain if native else None]
    try:
        yield
    finally:
        block_hash._chain[:] = saved


@pytest.fixture(scope="module")
def native_module():
    from pdpool import native_text as native

    module = native.load()
    assert module is not None
    return module


@settings(max_examples=500, deadline=None)
@given(text=ascii_texts)
def test_the_native_pieces_are_the_pattern_s_pieces(frontend, native_module, text):
    python = PieceEncoder(frontend.tokenizer, capacity=50, native=False)
    table = native_module.PieceTable(python._bpe, 50)
    pieces = python._pieces.findall(text)
    assert table.pieces(text) == pieces
    ids, ids_json = table.encode(text)   # no added tokens here: PieceEncoder splits the text around them first
    assert ids == [i for piece in pieces for i in python._bpe(piece)]
    if python._added.search(text) is None:
        assert ids == frontend.tokenizer.encode(text, False)
    assert ids_json == json.dumps(ids, separators=(",", ":")).encode()[1:-1]


@settings(max_examples=300, deadline=None)
@given(text=texts | st.text(max_size=60) | ascii_texts, capacity=st.integers(1, 8))
def test_the_native_path_with_a_tiny_table(frontend, text, capacity):
    """A table of a few pieces empties itself in the middle of a text: the ids stay exact (and alive)."""
    pieces = PieceEncoder(frontend.tokenizer, capacity=capacity)
    assert pieces.native
    expected = frontend.tokenizer.encode(text, False)
    for _ in range(2):
        assert pieces.encode(text) == expected
        ids, ids_json = pieces.encode_entry(text)
        assert ids == expected
        assert ids_json is None or ids_json == json.dumps(ids, separators=(",", ":")).encode()[1:-1]


@settings(max_examples=400, deadline=None)
@given(text=texts | ascii_texts | st.text(alphabet="<|>abc_ ", max_size=30))
def test_the_added_token_precheck_is_the_regex(frontend, text):
    """``encode_entry`` takes the native path exactly when the added-token regex finds nothing in an ASCII text:
    its one-character pre-check ('<' for the demo tokenizer) only skips searches that would find nothing."""
    pieces = PieceEncoder(frontend.tokenizer)
    assert pieces._added_first == "<"
    if pieces._added.search(text) is not None:
        assert pieces._added_first in text
    ids, ids_json = pieces.encode_entry(text)
    native = text.isascii() and pieces._added.search(text) is None   # the condition before the pre-check
    assert (ids_json is not None) == native and ids == frontend.tokenizer.encode(text, False)


def test_the_native_table_refuses_what_it_cannot_encode(native_module):
    table = native_module.PieceTable(lambda piece: [1], 4)
    with pytest.raises(ValueError):
        table.encode("日本")
    bad = native_module.PieceTable(lambda piece: ["x"], 4)
    with pytest.raises(TypeError):
        bad.encode("hello world")
    failing = native_module.PieceTable(lambda piece: 1 / 0, 4)
    with pytest.raises(ZeroDivisionError):
        failing.encode("hello")
    assert table.encode("") == ([], b"")


@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(0, 3), texts), min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 3, 16]), salt=st.sampled_from([None, "tenant"]),
       add_special=st.booleans(), capacity=st.integers(1, 40), use_native=st.booleans())
def test_the_block_hash_memo_gives_the_engines_hashes(frontend, native_module, prompts, block_size, salt,
                                                      add_special, capacity, use_native):
    """Prompts sharing a few system prompts, chunked small: the memo's hashes are ``hash_prompt_blocks``' bit for
    bit, cold and warm, whatever it kept or emptied."""
    from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash

    cache = TokenChunkCache(frontend.tokenizer, capacity=64, chunk_chars=4)
    memo = BlockHashMemo(capacity)
    systems = ["You are helpful. " * 3, "Answer briefly, in French. " * 2, "日本 🙂 <|im_start|> tools: none. ", ""]
    root = root_hash(ModelFingerprint("demo", "float32", block_size), salt)
    for _ in range(2):
        for system, question in prompts:
            ids, _, shared = cache.encode_chunked(systems[system] + question, add_special)
            with hash_loop(use_native):
                got = memo.hashes(ids, block_size, root, shared)
            with hash_loop(native=False):
                assert got == hash_prompt_blocks(ids, block_size, root)


def test_the_memo_hashes_only_the_fresh_tail(frontend, monkeypatch):
    from pdpool.block_hash import ModelFingerprint, hash_prompt_blocks, root_hash

    cached = Frontend(frontend.files, frontend.tokenizer, token_cache_chunks=256)
    fp = ModelFingerprint("demo", "float32", 16)
    system = "You are a careful assistant who answers in full sentences. " * 100
    for i in range(2):   # the first sees the system prompt's chunks fresh, the second adds them to the memo
        ids, _, shared = cached.encode_prompt_chunked(system + f" Question {i}: what is {i} squared?")
        cached.block_hashes(ids, fp, None, shared)
    hashed = []
    import pdpool.token_cache as token_cache_module

    real = token_cache_module.extend_block_hashes
    monkeypatch.setattr(token_cache_module, "extend_block_hashes",
                        lambda hashes, token_ids, *a: hashed.append(len(token_ids) // 16 - len(hashes))
                        or real(hashes, token_ids, *a))
    ids, _, shared = cached.encode_prompt_chunked(system + " Question 7: and what is 7 squared, then?")
    assert cached.block_hashes(ids, fp, None, shared) == hash_prompt_blocks(ids, 16, root_hash(fp))
    assert len(ids) // 16 > 40 and hashed and hashed[0] <= 3   # the fresh question's blocks (and the one the last shared chunk splits)
    assert cached.block_hashes(ids, fp, "salt", shared) != cached.block_hashes(ids, fp, None, shared)


@settings(max_examples=400, deadline=None)
@given(text=texts | st.text(max_size=80) | st.text(alphabet=" \t\n\xa0\u3000\u2028\x1cab", max_size=40),
       size=st.integers(1, 12))
def test_the_native_cuts_are_the_pattern_s_cuts(frontend, text, size):
    cache = TokenChunkCache(frontend.tokenizer, chunk_chars=size)
    assert cache._native_chunks is not None
    assert cache.chunks(text) == cache.chunks_re(text)


@settings(max_examples=300, deadline=None)
@given(token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=200), block_size=st.integers(1, 40),
       first=st.integers(0, 8), salt=st.sampled_from([None, "", "tenant-7"]), extra=st.booleans())
def test_the_native_hash_chain_is_the_engines_hash(native_module, token_ids, block_size, first, salt, extra):
    """``hash_chain`` (SHA-256 in C) against ``extend_block_hashes``' hashlib loop, bit for bit, from any start;
    and ``extend_block_hashes`` itself, which uses it."""
    import struct

    from pdpool.block_hash import ModelFingerprint, extend_block_hashes, hash_prompt_blocks, root_hash

    root = root_hash(ModelFingerprint("demo", "float32", block_size), salt)
    keys = ("img:1",) if extra else ()
    with hash_loop(native=False):
        expected = hash_prompt_blocks(token_ids, block_size, root, keys)
    start = min(first, len(expected))
    tokens = struct.pack(f"<{(len(expected) - start) * block_size}I",
                         *token_ids[start * block_size:len(expected) * block_size])
    tail = struct.pack("<I", 9) + struct.pack("<I", 5) + b"img:1" if extra else struct.pack("<I", 0)
    parent = expected[start - 1] if start else root
    assert native_module.hash_chain(parent, tokens, 4 * block_size, tail) == expected[start:]
    with hash_loop(native=True):
        assert extend_block_hashes(list(expected[:start]), token_ids, block_size, root, keys) == expected
        if not extra:
            assert BlockHashMemo(4).hashes(token_ids, block_size, root, None) == expected


def sha256_paths(module) -> list[str]:
    """The SHA-256 compressions this CPU can run: the portable C, and the x86 SHA extensions where it has them."""
    current = module.sha256_path()
    paths = ["portable"]
    try:
        module.sha256_path("sha-ni")
        paths.append("sha-ni")
    except ValueError:
        pass
    finally:
        module.sha256_path(current)
    return paths


def test_the_sha_extensions_are_used_where_the_cpu_has_them(native_module):
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and " sha_ni" in cpuinfo.read_text():   # Linux on x86 names the extensions so
        assert native_module.sha256_path() == "sha-ni"
        assert sha256_paths(native_module) == ["portable", "sha-ni"]
    else:
        assert native_module.sha256_path() == "portable"
    with pytest.raises(ValueError):
        native_module.sha256_path("md5")


@settings(max_examples=300, deadline=None)
@given(parent=st.binary(min_size=16, max_size=16), blocks=st.integers(0, 5), step=st.integers(1, 40).map(lambda b: 4 * b),
       tail=st.one_of(st.binary(max_size=200), st.integers(0, 140).map(lambda n: bytes(range(n % 256))[:n])),
       data=st.data())
def test_every_sha256_path_is_hashlib(native_module, parent, blocks, step, tail, data):
    """Each compression (portable, SHA extensions) against hashlib's SHA-256 for messages of every length mod 64
    (24 + step + len(tail) bytes: the padding's one- and two-block cases), bit for bit."""
    import hashlib
    import struct

    tokens = data.draw(st.binary(min_size=blocks * step, max_size=blocks * step))
    expected, h = [], parent
    for i in range(blocks):
        h = hashlib.sha256(struct.pack("<I", 16) + h + struct.pack("<I", step) + tokens[i * step:(i + 1) * step]
                           + tail).digest()[:16]
        expected.append(h)
    current = native_module.sha256_path()
    try:
        for path in sha256_paths(native_module):
            native_module.sha256_path(path)
            assert native_module.hash_chain(parent, tokens, step, tail) == expected, path
    finally:
        native_module.sha256_path(current)


def test_the_native_hash_chain_refuses_bad_framing(native_module):
    with pytest.raises(ValueError):
        native_module.hash_chain(b"x" * 15, b"", 4, b"\0\0\0\0")
    with pytest.raises(ValueError):
        native_module.hash_chain(b"x" * 16, b"abc", 4, b"\0\0\0\0")
    with pytest.raises(TypeError):
        native_module.hash_chain(b"x" * 16, "abcd", 4, b"\0\0\0\0")
    assert native_module.hash_chain(b"x" * 16, b"", 4, b"\0\0\0\0") == []


# ---- the chunk loop in C (pdpool/csrc/pieces.c's ChunkLRU) ---------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.tuples(texts | ascii_texts | st.text(max_size=40), st.booleans()), min_size=1, max_size=8),
       capacity=st.integers(0, 10), chunk_chars=st.integers(1, 6))
def test_the_c_chunk_loop_is_the_python_loop(frontend, calls, capacity, chunk_chars):
    """Small chunks and a few LRU entries (evictions within one text, a chunk that comes twice): the same ids, JSON,
    cached leading chunks, hit and miss counts and LRU order as the Python loop, call after call."""
    c = TokenChunkCache(frontend.tokenizer, capacity=capacity, chunk_chars=chunk_chars)
    py = TokenChunkCache(frontend.tokenizer, capacity=capacity, chunk_chars=chunk_chars, native=False)
    assert c._native_lru is not None and py._native_lru is None
    for text, add_special in calls * 2:
        text = text * 3   # long enough to be chunked (2 * chunk_chars)
        got = c.encode_chunked(text, add_special)
        assert got == py.encode_chunked(text, add_special)
        assert got[0] == frontend.tokenizer.encode(text, add_special)
        assert (c.hit_chunks, c.missed_chunks) == (py.hit_chunks, py.missed_chunks)
        assert c._native_lru.keys() == list(py._lru) and len(c._native_lru) == len(py._lru) <= capacity


def test_the_c_chunk_loop_refuses_bad_input_and_keeps_no_reference(native_module):
    import gc
    import sys

    ids, chunk = [7, 8], "".join(["ab", "cd"])
    base = sys.getrefcount(ids), sys.getrefcount(chunk)
    lru = native_module.ChunkLRU(2, lambda text: [ids if text == chunk else [5], None])
    assert lru.run([chunk, "x"], [1], b"1") == ([1, 7, 8, 5], b"[1,7,8,5]", (), 0, 2)
    assert lru.run([chunk], [], None) == ([7, 8], b"[7,8]", ((chunk, 2),), 1, 0)
    assert lru.keys() == ["x", chunk]
    lru.run(["y", "z"], [], None)                      # both evicted
    assert (sys.getrefcount(ids), sys.getrefcount(chunk)) == base
    lru.run([chunk], [], None)
    del lru
    gc.collect()
    assert (sys.getrefcount(ids), sys.getrefcount(chunk)) == base
    with pytest.raises(TypeError, match="chunks must be str"):
        native_module.ChunkLRU(2, lambda text: [[1], None]).run(["a", b"b"], [], None)
    with pytest.raises(TypeError, match="encode_fresh must return"):
        native_module.ChunkLRU(2, lambda text: (1, 2)).run(["a"], [], None)
    with pytest.raises(TypeError, match="ints of 64 bits"):
        native_module.ChunkLRU(2, lambda text: [["1"], None]).run(["a"], [], None)
    with pytest.raises(ZeroDivisionError):
        native_module.ChunkLRU(2, lambda text: 1 / 0).run(["a"], [], None)
    with pytest.raises(ValueError):
        native_module.ChunkLRU(-1, lambda text: None)
    holder = []
    reentrant = native_module.ChunkLRU(2, lambda text: holder[0].run(["q"], [], None))
    holder.append(reentrant)
    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        reentrant.run(["a"], [], None)
    holder.clear()


def test_encoders_and_caches_are_freed_when_dropped(frontend):
    """No reference cycle through the C tables (which the collector does not track): each leaked 25 MB of table
    per encoder, and a test process that had made a few hundred could no longer fork."""
    import weakref

    for make in (lambda: PieceEncoder(frontend.tokenizer), lambda: TokenChunkCache(frontend.tokenizer)):
        obj = make()
        assert obj.native if isinstance(obj, PieceEncoder) else obj.pieces.native
        ref = weakref.ref(obj)
        del obj
        assert ref() is None   # freed by its refcount alone, with no collection
