"""Per-request sampling parameters (vLLM / OpenAI names) and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `param` names the field (the OpenAI server answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs to return beside the sampled token's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        _int("n", self.n, 1, 1, "only n=1 is supported")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, None)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, "at most max_tokens" if self.max_tokens else "")
        _num("temperature", self.temperature, 0.0, None)
        _num("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, -1, None, "-1 or 0 disables it")
        _num("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, None, None)
        _num("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, None)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a boolean, got {getattr(self, name)!r}")


def _range(low, high, low_open=False) -> str:
    lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
    return f"{lo}, {'inf)' if high is None else f'{high}]'}"


def _int(name: str, value, low, high, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        hint = f" ({hint})" if hint else ""
        raise SamplingParamsError(name, f"{name} must be in {_range(low, high)}{hint}, got {value!r}")


def _num(name: str, value, low, high, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high) or math.isinf(value):
        raise SamplingParamsError(name, f"{name} must be in {_range(low, high, low_open)}, got {value!r}")
