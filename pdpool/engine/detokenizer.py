"""Incremental, UTF-8-safe detokenization of one request, with stop strings.

Text comes from decoding a sliding window of ids (vLLM's prefix/read offsets):

    ids:  | prompt ... | output ...                              |
                 ^ prefix_offset      ^ read_offset             ^ len(ids)
          decode(ids[prefix:read]) = prefix_text   (already emitted, gives context: spaces, merges)
          decode(ids[prefix:])     = prefix_text + new text, kept back while it ends in U+FFFD (a partial
                                     UTF-8 character that a later byte-level token completes)

`output_text` holds all text so far (cut at a stop string); what `add_tokens` returns stops short of any tail
that could start a stop string, so streamed text never holds part of a stop string that is later cut.
Concatenating every `add_tokens(...)` and the final `flush()` gives exactly `output_text`.
"""

from __future__ import annotations

import json

from pdpool.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt ids decoded as context for the first output token (as vLLM)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 token_texts: dict[int, str] | None = None):
        """``token_texts``: the text of single ids decoded alone, shared by the requests of one tokenizer and
        ``skip_special_tokens`` setting (``OutputProcessor`` keeps one per setting)."""
        self.tokenizer = tokenizer
        self.params = params
        self._token_texts = {} if token_texts is None else token_texts
        self.token_ids: list[int] = []  # output ids taken; ids after a stop string are not taken
        self.output_text = ""
        self.finished = False
        self.stop_reason: str | None = None
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._checked_len = 0  # output_text[:_checked_len] has been searched for stop strings
        self._emitted_len = 0  # output_text[:_emitted_len] has been returned to the caller

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Take new output ids (stopping at a stop string) and return the text that is now safe to stream."""
        for token_id in new_token_ids:
            if self.finished:
                break
            self.token_ids.append(token_id)
            self._ids.append(token_id)
            self._append(self._decode_new(final=False))
        return self._release()

    def flush(self) -> str:
        """The request ends (EOS, length, abort, or stop string): return all text not yet streamed, including
        an undecodable byte tail, which then reads as U+FFFD as it would in a one-shot decode."""
        if not self.finished:
            self._append(self._decode_new(final=True))
        self.finished = True
        return self._release()

    def _decode_new(self, final: bool) -> str:
        skip = self.params.skip_special_tokens
        if self._read_offset - self._prefix_offset == 1:  # the common case: the one id emitted last time
            token = self._ids[self._prefix_offset]
            prefix_text = self._token_texts.get(token)
            if prefix_text is None:
                prefix_text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=skip)
        else:
            prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                                skip_special_tokens=skip)
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _append(self, text: str) -> None:
        self.output_text += text
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            self._checked_len = len(self.output_text)
            return
        found = None  # (index, stop string) of the earliest match in the unchecked tail
        for stop in self.params.stop:
            index = self.output_text.find(stop, max(0, self._checked_len - len(stop) + 1))
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        self._checked_len = len(self.output_text)
        if found:
            index, stop = found
            end = index + len(stop) if self.params.include_stop_str_in_output else index
            self.output_text = self.output_text[:end]
            self.finished, self.stop_reason = True, stop

    def _release(self) -> str:
        end = len(self.output_text)
        if not self.finished and not self.params.include_stop_str_in_output:
            end -= _partial_stop_len(self.output_text, self.params.stop)
        end = max(end, self._emitted_len)
        delta = self.output_text[self._emitted_len:end]
        self._emitted_len = end
        return delta


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def detokenize_once(tokenizer, prompt_token_ids: list[int], token_ids: list[int], params: SamplingParams,
                    token_texts: dict[int, str] | None = None, local: bool = False) -> str:
    """The text of a whole output at once, for a request without stop strings that streams nothing: exactly the
    ``output_text`` of an ``IncrementalDetokenizer`` fed ``token_ids`` and flushed.

    With ``local`` (``decodes_locally(tokenizer)``), that is one decode of context + output, cut after the
    context's text: two tokenizer calls per request instead of about two per token. Such a decoder gives every
    token the same text in any window that does not start at it, so the incremental windows' pieces add up to the
    one-shot text wherever the bytes are valid UTF-8. Where they are not (U+FFFD anywhere), the incremental
    hold-back may cut a byte group that a decoder judges as a whole (``ByteFallback``), so the incremental pass
    runs here instead, as it would have step by step.
    """
    if params.stop:
        raise ValueError("detokenize_once: stop strings need the incremental pass")
    if local:
        skip = params.skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = tokenizer.decode(context, skip_special_tokens=skip)
        full_text = tokenizer.decode(context + list(token_ids), skip_special_tokens=skip)
        if "\ufffd" not in full_text and full_text.startswith(context_text):
            return full_text[len(context_text):]
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params, token_texts)
    detok.add_tokens(token_ids)
    detok.flush()
    return detok.output_text


# Decoders (``tokenizers``' types) whose text of a token does not depend on the tokens after it, nor on those
# before it beyond "is it the window's first token" and the joint UTF-8 decoding of bytes. Not listed, so not
# local: BPEDecoder (the last token differs), CTC (merges repeats), WordPiece with its own clean-up.
_LOCAL_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Strip", "Replace"}


def decodes_locally(tokenizer) -> bool:
    """Whether ``detokenize_once`` may decode this tokenizer's outputs in one call: no clean-up of spaces after
    decoding (it looks across tokens) and a decoder made only of local steps. A tokenizer it cannot inspect
    (pdpool's ``frontend.Tokenizer`` and HF fast tokenizers are inspected) gets the incremental pass."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - not a tokenizers decoder: take the incremental pass
        return False
    steps = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    return all(step.get("type") in _LOCAL_DECODERS
               or (step.get("type") == "WordPiece" and not step.get("cleanup", True)) for step in steps)


Detokenizer = IncrementalDetokenizer  # the name the architecture table uses
