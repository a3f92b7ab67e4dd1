"""Per-request sampling parameters (vLLM / OpenAI names) and their validation.

``validate()`` is the edge check: a request that passes it cannot make the sampler fail. Every number is finite
(and finite in float32, where the sampler works), every id is in range, and the seed fits a torch generator. No
torch import here: the router validates with this module too.

``logit_bias`` (OpenAI's, as vLLM takes it): token id -> a bias added to that token's logit before sampling, on
every generated token. Keys are ints or, as JSON object keys are, decimal strings ("50256"); values are numbers
(not bools), finite, and clamped to [-100, 100] as vLLM's ``SamplingParams.from_optional`` clamps them (OpenAI
documents that range; a vLLM client sending 150 gets 100 there, so it does here, instead of a 400). ``None`` or
``{}`` means no bias (stored as ``None``). At most ``MAX_LOGIT_BIAS_ENTRIES`` entries before ids are checked; with
the vocabulary known (``validate(vocab_size)``), every id must be in [0, vocab_size), which bounds the distinct
entries by the vocab size.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import MISSING, dataclass, field, fields, replace

MAX_LOGPROBS = 20
# vLLM's bounds for `seed` (torch.long). torch.Generator.manual_seed takes [-2**63, 2**64 - 1] and maps a negative
# seed s to 2**64 + s, so every seed in this range seeds a generator, negative ones included.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
GREEDY_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow the logits
MAX_TEMPERATURE = 2.0  # vLLM's bound (0.32's SamplingParams refuses a higher one)
_FLOAT32_MAX = 3.4028234663852886e38
LOGIT_BIAS_MAX = 100.0  # |bias| is clamped to it (OpenAI's documented range, vLLM's clamp)
# Entries a logit_bias may have before its ids are checked against the vocabulary: above any common vocabulary
# (Llama 3: 128256, Qwen 2: 151936, Gemma 3: 262144); the ids' range check then bounds it by the vocab size.
MAX_LOGIT_BIAS_ENTRIES = 1 << 19
_TOKEN_ID_KEY = re.compile(r"[+-]?[0-9]{1,19}")  # ASCII digits only (int() also takes other scripts' digits)


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
    detokenize: bool = True  # vLLM's: False leaves the output's text empty (token ids only); no stop strings then
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] (see the module docstring)
    # the prompt's own logprobs, each with this many best beside it (vLLM's; completions' echo with logprobs): the
    # model's distribution at every prompt position, so such a request reads nothing from the prefix cache
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1: the last max_model_len (``truncate_prompt``)
    truncate_prompt_tokens: int | None = None
    # vLLM's: only these ids may be generated (every other logit masked, before the bias and the penalties)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated; the front end fills ``bad_words_token_ids`` (``Frontend.bad_words_token_ids``)
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's structured output (or OpenAI's response_format): the output must match a JSON schema, a regex, one of
    # some strings or a grammar (``pdpool.engine.structured``); a dict of vLLM's names or a ``StructuredOutputs``.
    # The front end compiles it into ``grammar``, which the sampler enforces.
    structured_outputs: object | None = None
    grammar: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.seed) is int and self.seed == -1:   # vLLM's: -1 is no seed (random), not a generator's seed
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:   # vLLM's: True asks for the one best beside the token
                setattr(self, name, 1)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise SamplingParamsError("stop", "stop must be a string or a list of strings, got "
                                      f"{short_repr(self.stop)}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of integers, got "
                                      f"{short_repr(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise SamplingParamsError("bad_words", f"bad_words must be a list of strings, got "
                                          f"{short_repr(self.bad_words)}")
            self.bad_words = list(self.bad_words) or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token "
                                          f"ids, got {short_repr(self.allowed_token_ids)}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            from pdpool.engine.structured import StructuredOutputs

            self.structured_outputs = StructuredOutputs.parse(self.structured_outputs)
        self.validate()

    @classmethod
    def defaults(cls, max_tokens: int | None = 16, logprobs: int | None = None) -> "SamplingParams":
        """``cls(max_tokens=max_tokens, logprobs=logprobs)``: the same object and the same refusals, without
        checking the other fields' defaults again on every request (they are valid: checked once, at import). The
        two given fields are checked here, in ``validate()``'s order (the OpenAI server's body without any
        sampling field; a test compares the two)."""
        if max_tokens is not None:
            _int("max_tokens", max_tokens, 1, None)   # then min_tokens 0 <= max_tokens holds
        if logprobs is True:
            logprobs = 1
        if logprobs is not None:
            _int("logprobs", logprobs, 0, MAX_LOGPROBS)
        params = object.__new__(cls)
        values = params.__dict__
        values.update(_DEFAULTS)                   # every field, in the fields' order (as __init__ sets them)
        for name, make in _DEFAULT_FACTORIES:
            values[name] = make()
        values["max_tokens"], values["logprobs"] = max_tokens, logprobs
        return params

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's ``SamplingParams.from_optional``: a ``None`` for a field that has a number by default (``n``,
        ``temperature``, ``top_p``, the penalties) takes that default; any other ``None`` stays (``max_tokens=None``:
        up to the context length)."""
        return cls(**{name: _DEFAULTS[name] if value is None and name in _OPTIONAL_NUMBERS else value
                      for name, value in kwargs.items()})

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's ``clone``; a compiled ``grammar`` is shared, not copied."""
        return copy.deepcopy(self, {id(self.grammar): self.grammar} if self.grammar is not None else None)

    def for_choice(self, j: int) -> "SamplingParams":
        """Choice ``j`` of ``n``: an engine request samples one sequence, so ``n`` choices are ``n`` requests (the
        server's and the offline ``LLM``'s alike); with a seed, choice ``j`` takes ``seed + j``, so that choices
        differ, reproducibly."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + j)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def bad_words_read_output(self) -> bool:
        """A bad word of several tokens is banned after its first ones: its row's sampling reads the output ids."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    @property
    def reads_output(self) -> bool:
        """Its sampling reads every earlier output id whatever the step: penalties, a bad word of several tokens, a
        grammar (``min_tokens`` reads only their count, until it is met)."""
        return self.has_penalties or self.bad_words_read_output or self.grammar is not None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``SamplingParamsError`` naming the first bad field. With ``vocab_size`` (the engine's front end
        knows it), ``stop_token_ids`` and ``logit_bias``' ids must also be below it."""
        _int("n", self.n, 1, None)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, None)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, "at most max_tokens" if self.max_tokens else "")
        _num("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.n > 1 and self.temperature < GREEDY_TEMPERATURE:   # vLLM's: the n choices would be one sequence
            raise SamplingParamsError("n", f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        _num("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, -1, None, "-1 or 0 disables it")
        _num("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, SEED_MIN, SEED_MAX)
        _num("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)   # vLLM's: > 0, finite
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, None, "-1 or at least 1")
            if self.truncate_prompt_tokens == 0:
                raise SamplingParamsError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's "
                                          "context length) or at least 1, got 0")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop must be non-empty strings, got {short_repr(s)}")
        top = None if vocab_size is None else vocab_size - 1
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, top, "the vocabulary's ids" if top is not None else "")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, top)
        for t in self.allowed_token_ids or ():
            _int("allowed_token_ids", t, 0, top, "the vocabulary's ids" if top is not None else "")
        for ids in self.bad_words_token_ids or ():
            for t in ids:
                _int("bad_words", t, 0, top, "the vocabulary's ids" if top is not None else "")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a boolean, got {short_repr(getattr(self, name))}")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("detokenize", "stop strings need the text: set detokenize=True to use stop")


def normalize_logit_bias(bias) -> dict[int, float] | None:
    """A client's ``logit_bias`` as ``{token_id: bias}``: keys ints (decimal strings parsed), values floats clamped
    to [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]; ``None`` when empty. ``SamplingParamsError`` (param ``logit_bias``) for
    anything else: not an object, a key that is no integer, a value that is no finite number (a bool is none)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "logit_bias must be an object mapping token ids to numbers, got "
                                  f"{short_repr(bias)}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingParamsError("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                                  f"{len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (integers), got "
                                      f"{short_repr(key)}")
        out[token] = _bias_value(token, value)
    return out or None


def _bias_value(token: int, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError("logit_bias", f"logit_bias[{short_repr(token, 24)}] must be a number, got "
                                  f"{short_repr(value)}")
    if isinstance(value, int):  # any size: compared exactly, then clamped
        return float(max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, value)))
    if not math.isfinite(value):
        raise SamplingParamsError("logit_bias", f"logit_bias[{short_repr(token, 24)}] must be a finite number, got "
                                  f"{value!r}")
    return max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, value))


def _check_logit_bias(bias, top: int | None) -> None:
    """A normalized ``logit_bias`` (or one set behind ``__post_init__``'s back): int ids in [0, top], float values in
    the clamp range."""
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"logit_bias must be a dict, got {short_repr(bias)}")
    bad = [t for t in bias if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (top is not None and t > top)]
    if bad:
        where = f"[0, {top + 1}) (the vocab size)" if top is not None else "[0, vocab size)"
        raise SamplingParamsError("logit_bias", f"logit_bias token ids must be in {where}, got "
                                  f"{short_repr(bad[:5])}")
    for t, v in bias.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            raise SamplingParamsError("logit_bias", f"logit_bias[{t}] must be a number in [-{LOGIT_BIAS_MAX}, "
                                      f"{LOGIT_BIAS_MAX}], got {short_repr(v)}")


def _range(low, high, low_open=False) -> str:
    lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
    return f"{lo}, {'inf)' if high is None else f'{high}]'}"


def short_repr(value, limit: int = 80) -> str:
    """``repr`` for an error message, cut short: a client's value may be huge."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits() has no repr
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


def _int(name: str, value, low, high, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be an integer, got {short_repr(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        hint = f" ({hint})" if hint else ""
        raise SamplingParamsError(name, f"{name} must be in {_range(low, high)}{hint}, got {short_repr(value)}")


def _num(name: str, value, low, high, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"{name} must be a number, got {short_repr(value)}")
    try:
        x = float(value)  # an int beyond float's range overflows here
    except OverflowError:
        x = math.inf
    if math.isnan(x):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    too_low = x <= low if low_open else x < low
    if too_low or (high is not None and x > high) or math.isinf(x):
        raise SamplingParamsError(name, f"{name} must be in {_range(low, high, low_open)}, got {short_repr(value)}")
    if abs(x) > _FLOAT32_MAX:  # the sampler works in float32, where this is inf
        raise SamplingParamsError(name, f"{name} must be a finite float32 number, got {short_repr(value)}")


_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}   # a factory's field: set per object
_DEFAULT_FACTORIES = tuple((f.name, f.default_factory) for f in fields(SamplingParams)
                           if f.default_factory is not MISSING)
_OPTIONAL_NUMBERS = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
SamplingParams().validate()   # the defaults that ``SamplingParams.defaults`` does not check again


def generation_defaults(model_path, model_config):
    """A node's generation defaults (``pdpool.frontend.GenerationDefaults``) from ``--generation-config`` and
    ``--override-generation-config``, each value checked as a request's would be: a bad one stops the load with
    ``ValueError`` naming it, rather than failing every request."""
    from pdpool.config import generation_override
    from pdpool.frontend import GenerationDefaults

    defaults = GenerationDefaults.read(model_path, model_config.generation_config, generation_override(model_config))
    try:
        SamplingParams(**defaults.sampling, max_tokens=defaults.max_tokens).validate()
        if defaults.max_tokens_cap is not None:
            _int("max_tokens", defaults.max_tokens_cap, 1, None)
    except (SamplingParamsError, TypeError) as exc:
        raise ValueError(f"the generation config's defaults {defaults.sampling} are not valid: {exc}") from None
    if defaults:
        logging.getLogger("pdpool").info(
            "requests' unset sampling fields default to %s%s, from --generation-config %s%s (vLLM's rule; "
            "--generation-config vllm turns the model's off)", defaults.sampling,
            f", chats' max_tokens to {defaults.max_tokens}" if defaults.max_tokens is not None else "",
            model_config.generation_config, " and --override-generation-config"
            if model_config.override_generation_config else "")
    return defaults
