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


Detokenizer = IncrementalDetokenizer  # the name the architecture table uses
