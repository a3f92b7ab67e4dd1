"""The requests of a run: ``random``, ``shared-prefix`` (inference-perf's shape), a JSONL file or a ShareGPT file
(vLLM's ``sharegpt``).

Lengths are in tokens when a tokenizer is at hand (``pdpool.frontend``, no torch), else in words; ``Lengths``
hides which. Each generator is deterministic in its seed.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


@dataclass
class BenchRequest:
    """One request: exactly one of ``prompt`` (text or token ids) and ``messages``."""
    prompt: str | list[int] | None
    messages: list[dict] | None
    prompt_len: int      # the local count (tokens or words); the server's usage replaces it when it reports one
    max_tokens: int
    group: int | None = None


class Lengths:
    """Text of a given length, and the length of a text: in tokens with ``frontend``, else in words."""

    def __init__(self, frontend=None) -> None:
        self.frontend = frontend

    @property
    def unit(self) -> str:
        return "tokens" if self.frontend is not None else "words"

    def count(self, text: str) -> int:
        if self.frontend is None:
            return len(text.split())
        return len(self.frontend.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n: int, rng: random.Random) -> str:
        """About ``n`` units of random words (exactly ``n`` words; ``n`` tokens up to re-tokenization)."""
        words = [rng.choice(WORDS) for _ in range(n)]
        if self.frontend is None:
            return " ".join(words)
        tokenizer = self.frontend.tokenizer
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        while len(ids) < n:
            words += [rng.choice(WORDS) for _ in range(n - len(ids))]
            ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        return tokenizer.decode(ids[:n])

    def token_ids(self, n: int, rng: random.Random) -> list[int]:
        if self.frontend is None:
            raise ValueError("token-id prompts need a tokenizer (--tokenizer demo or a model folder)")
        special = set(self.frontend.eos_token_ids)
        ids: list[int] = []
        while len(ids) < n:
            token = rng.randrange(self.frontend.vocab_size)
            if token not in special:
                ids.append(token)
        return ids


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` -> (64, 256), both ends included."""
    low, _, high = str(text).partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {text!r}: need 1 <= min <= max")
    return lo, hi


def ratio_range(n: int, ratio: float) -> tuple[int, int]:
    """vLLM's ``--random-range-ratio``: lengths drawn from ``[floor(n * (1 - ratio)), ceil(n * (1 + ratio))]``
    (at least 1)."""
    return max(1, math.floor(n * (1 - ratio))), math.ceil(n * (1 + ratio))


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], lengths: Lengths,
                    seed: int, token_ids: bool = False) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(*input_len)
        prompt: str | list[int] = lengths.token_ids(n, rng) if token_ids else lengths.text(n, rng)
        out.append(BenchRequest(prompt, None, n, rng.randint(*output_len)))
    return out


def shared_prefix_requests(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                           output_len: int, lengths: Lengths, seed: int, chat: bool = False) -> list[BenchRequest]:
    """``num_groups`` system prompts, each followed by ``prompts_per_group`` different questions, in a shuffled
    order (inference-perf's ``shared_prefix``). Completions get ``system + "\\n" + question``; chat gets a system
    and a user message."""
    rng = random.Random(seed)
    out = []
    for group in range(num_groups):
        system = lengths.text(system_prompt_len, rng)
        for _ in range(prompts_per_group):
            question = lengths.text(question_len, rng)
            if chat:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                out.append(BenchRequest(None, messages, system_prompt_len + question_len, output_len, group))
            else:
                out.append(BenchRequest(f"{system}\n{question}", None, system_prompt_len + question_len, output_len,
                                        group))
    rng.shuffle(out)
    return out


def is_int(value) -> bool:
    """A JSON integer (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def jsonl_requests(path: Path, default_output_len: int, lengths: Lengths) -> list[BenchRequest]:
    """One JSON object a line: ``{"prompt": text | [ids]}`` or ``{"messages": [...]}``, optionally with
    ``"max_tokens"`` (else ``default_output_len``). Blank lines are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
                raise ValueError(f"{path}:{number}: need an object with exactly one of 'prompt' and 'messages'")
            max_tokens = item.get("max_tokens", default_output_len)
            if not is_int(max_tokens) or max_tokens < 1:
                raise ValueError(f"{path}:{number}: max_tokens must be an integer >= 1, not {max_tokens!r}")
            if "messages" in item:
                messages = item["messages"]
                if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                    raise ValueError(f"{path}:{number}: messages must be a non-empty list of objects")
                text = " ".join(str(m.get("content", "")) for m in messages)
                out.append(BenchRequest(None, messages, lengths.count(text), max_tokens))
            else:
                prompt = item["prompt"]
                if isinstance(prompt, list) and prompt and all(map(is_int, prompt)):
                    n = len(prompt)
                elif isinstance(prompt, str):
                    n = lengths.count(prompt)
                else:
                    raise ValueError(f"{path}:{number}: prompt must be a string or a non-empty list of token ids")
                out.append(BenchRequest(prompt, None, n, max_tokens))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's filter


def sharegpt_requests(path: Path, num: int, lengths: Lengths, seed: int, output_len: int | None = None,
                      shuffle: bool = True) -> list[BenchRequest]:
    """vLLM's ``sharegpt`` dataset: a JSON list of ``{"conversations": [{"value": ...}, ...]}``. In a seeded shuffle
    of the conversations of two turns or more, the first turn is the prompt and the second's length the
    ``max_tokens`` (or ``output_len``); pairs shorter than 4 units, prompts over 1024 or pairs over 2048 are skipped,
    until ``num`` requests are made (fewer when the file runs out)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")

    def first_two_turns(item) -> tuple[str, str] | None:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            return None
        values = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        return (values[0], values[1]) if all(isinstance(v, str) for v in values) else None

    pairs = [pair for pair in map(first_two_turns, data) if pair is not None]
    if shuffle:
        random.Random(seed).shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        if len(out) == num:
            break
        prompt_len = lengths.count(prompt)
        max_tokens = output_len or lengths.count(completion)
        if (prompt_len < SHAREGPT_MIN_LEN or (output_len is None and max_tokens < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + max_tokens > SHAREGPT_MAX_TOTAL_LEN):
            continue
        out.append(BenchRequest(prompt, None, prompt_len, max_tokens))
    if not out:
        raise ValueError(f"{path}: no conversation of two turns within the lengths")
    return out


def chat_templated(requests: list[BenchRequest], lengths: Lengths) -> list[BenchRequest]:
    """vLLM's ``custom`` dataset on the completions endpoint: each text prompt as one user message through the
    model's chat template (token-id prompts and message lists as they are)."""
    if lengths.frontend is None:
        raise ValueError("--dataset custom applies the model's chat template: give --tokenizer, or "
                         "--skip-chat-template")
    out = []
    for r in requests:
        if isinstance(r.prompt, str):
            text = lengths.frontend.render_chat([{"role": "user", "content": r.prompt}])
            r = BenchRequest(text, None, lengths.count(text), r.max_tokens, r.group)
        out.append(r)
    return out


def take(requests: list[BenchRequest], num: int) -> list[BenchRequest]:
    """The first ``num`` requests, cycling through a shorter list."""
    return [requests[i % len(requests)] for i in range(num)]
