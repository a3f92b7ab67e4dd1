"""Offline API: ``LLM("demo").generate(prompts, SamplingParams(...))``, results in input order, shaped as vLLM's::

    for out in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16)):
        print(out.prompt, out.outputs[0].text, out.outputs[0].token_ids, out.prompt_token_ids)

A prompt is a string, a list of token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dicts (``{"prompt": ...}``,
``{"prompt_token_ids": [...]}``). ``chat`` takes one conversation or a list of them and returns a list, as vLLM's.

The same pieces as a server, in one thread: the front end tokenizes, the engine steps, the output processor
detokenizes and applies stop strings.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, NotRequired, Sequence, TypedDict

from pdpool import config
from pdpool.engine.llm_engine import LLMEngine, TokenLogprobs
from pdpool.engine.output_processor import OutputProcessor, RequestOutput
from pdpool.engine.sampling_params import SamplingParams, generation_defaults, short_repr
from pdpool.engine.structured import Grammars
from pdpool.frontend import Frontend, InvalidRequestError, ModelFiles, Tokenizer, message_text


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: a prompt as text."""
    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: a prompt as token ids (``prompt``, if given, is only what the output shows)."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


Prompt = str | list[int] | TextPrompt | TokensPrompt


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's logprob at a position, its rank in the vocabulary (1: the model's first
    choice) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(dict):
    """One position's logprobs as vLLM gives them, ``{token id: Logprob}``: the position's token first, then the
    ``top`` best (ranks 1..). It keeps the engine's ``TokenLogprobs`` fields too (``token_id``, ``logprob``,
    ``top``, ``rank``), which pdpool's offline results gave before."""
    __slots__ = ("token_id", "logprob", "top", "rank")

    @classmethod
    def of(cls, entry: TokenLogprobs, tokenizer: Tokenizer | None) -> "PositionLogprobs":
        """``tokenizer``: each token's ``decoded_token`` (None without: ``detokenize=False``), the id decoded alone
        with special tokens kept, as vLLM's (transformers' ``decode`` default)."""
        def text(token_id: int) -> str | None:
            return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)

        top = entry.top or []
        # the token's place among the top ones when it is there (vLLM's: the top entry overwrites it), else the
        # engine's count of the ids at least as likely
        rank = next((i for i, (t, _) in enumerate(top, start=1) if t == entry.token_id), entry.rank)
        out = cls({entry.token_id: Logprob(entry.logprob, rank, text(entry.token_id))})
        for i, (t, lp) in enumerate(top, start=1):
            if t not in out:
                out[t] = Logprob(lp, i, text(t))
        out.token_id, out.logprob, out.top, out.rank = entry.token_id, entry.logprob, entry.top, entry.rank
        return out


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's ``CompletionOutput``); ``logprobs``, with the params' ``logprobs``, is one
    ``{token id: Logprob}`` per token (``PositionLogprobs``), and ``cumulative_logprob`` their sampled tokens' sum
    (else both None, as vLLM's)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None
    # vLLM's, None here as there without their feature: LoRA, routed experts, a sampling mask, speculative decoding
    lora_request: None = None
    routed_experts: None = None
    sampling_mask: None = None
    spec_decode_metrics: None = None
    weight_versions: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """What ``generate`` returns per prompt (vLLM's offline ``RequestOutput``, exported as ``pdpool.RequestOutput``);
    ``text``, ``output_token_ids``, ``finish_reason``, ``stop_reason`` and ``logprobs`` read its first (only)
    sequence. ``metrics`` is None, as vLLM's offline ``LLM`` (stats off) gives."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    # with the params' prompt_logprobs, as vLLM's: None for the first token, then one {token id: Logprob} each
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: None = None
    # vLLM's, None here as there without their feature: LoRA, an encoder-decoder model, a KV connector, an encoder
    # cache transfer, prompt_logprob_token_ids
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    prompt_token_id_logprobs: None = None

    @classmethod
    def from_final(cls, outs: Sequence[RequestOutput], tokenizer: Tokenizer | None) -> "GenerationResult":
        """One prompt's result from its ``n`` choices' final outputs (one engine request each, in choice order).
        ``tokenizer``: the logprobs' ``decoded_token``; None (``detokenize=False``): no text at all."""
        seqs = []
        for j, out in enumerate(outs):
            logprobs = cumulative = None
            if out.logprobs is not None:
                logprobs = [PositionLogprobs.of(e, tokenizer) for e in out.logprobs]
                cumulative = sum(e.logprob for e in out.logprobs)
            seqs.append(CompletionOutput(j, (out.text or "") if tokenizer is not None else "",
                                         out.output_token_ids or [], cumulative, logprobs, out.finish_reason,
                                         out.stop_reason))
        first, prompt_logprobs = outs[0], None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None if e is None else PositionLogprobs.of(e, tokenizer) for e in first.prompt_logprobs]
        return cls(first.request_id, first.prompt, first.prompt_token_ids, seqs, all(o.finished for o in outs),
                   first.num_cached_tokens, prompt_logprobs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs


class HFTokenizerView:
    """``LLM.get_tokenizer()``: pdpool's ``Tokenizer`` called as vLLM scripts call the transformers tokenizer vLLM
    returns: ``apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)`` (``tokenize``
    defaults to True: the ids, ``add_generation_prompt`` to False, extra keywords are template variables) and
    ``decode`` keeping special tokens unless told (transformers' default). Everything else is the ``Tokenizer``'s."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":   # not set yet (a copy or an unpickled view): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.special_tokens.get("eos_token")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **template_kwargs: Any) -> str | list[int]:
        text = self.tokenizer.apply_chat_template(chat_messages(conversation), add_generation_prompt,
                                                  continue_final_message, tools, chat_template,
                                                  template_kwargs or None)
        return self.tokenizer.encode(text, add_special_tokens=False) if tokenize else text


def parse_prompt(prompt: Any) -> tuple[str | None, str | list[int]]:
    """One prompt of ``generate`` as (the text the output shows, what the front end encodes). ``TypeError`` or
    ``ValueError`` naming the prompt for anything else (vLLM's prompt forms, less those pdpool has not: multimodal
    data, embeddings, encoder-decoder)."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if extra:
            raise ValueError(f"prompt {short_repr(prompt)}: pdpool takes only 'prompt' or 'prompt_token_ids' "
                             f"(no {', '.join(map(repr, extra))})")
        if "prompt_token_ids" in prompt:
            shown = prompt.get("prompt")
            if shown is not None and not isinstance(shown, str):
                raise TypeError(f"prompt['prompt'] must be a string, got {short_repr(shown)}")
            return shown, _token_ids(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got {short_repr(prompt)}")
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt['prompt'] must be a string, got {short_repr(prompt['prompt'])}")
        return prompt["prompt"], prompt["prompt"]
    return None, _token_ids(prompt)


def _token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {short_repr(ids)}")
    return list(ids)   # the front end checks each id against the vocabulary (a ValueError naming the prompt)


def chat_messages(conversation: Sequence[dict]) -> list[dict]:
    """One conversation's messages with their content as the server's chat takes it (``message_text``: OpenAI's
    text parts joined, as vLLM's); a ValueError naming ``messages`` for a message that is no dict with a role."""
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a 'role', got {short_repr(message)}",
                                      param="messages")
        out.append({**message, "content": message_text(message.get("content"), i)})
    return out


_POOLING_ONLY = "LLM.{}() is only supported for pooling models; pdpool serves generative models"


def _unset_only(**arguments: Any) -> None:
    """vLLM's arguments whose default (None or empty) is what pdpool does: anything else is a ValueError naming it."""
    for name, value in arguments.items():
        if value:
            raise ValueError(f"{name}={short_repr(value)}: pdpool takes no {name} (leave it unset)")


def _is_one_prompt(prompts: Any) -> bool:
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], int))


def _per_prompt(name: str, value: Any, count: int, kind: type) -> list:
    """``value`` for each of ``count`` prompts: one for all, or a sequence of exactly ``count``."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} prompts: give one, or one per prompt")
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise TypeError(f"{name} must be {kind.__name__} or a list of them, got {short_repr(v)}")
    return values


class LLM:
    """``LLM(model, dtype=..., **settings)``: settings are any names of the config schema (``max_num_seqs``,
    ``block_size``, ``num_threads``, ...)."""

    def __init__(self, model: str = "demo", *, dtype: str = "auto", tokenizer: str | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, trust_remote_code: bool = False,
                 disable_log_stats: bool = True, **settings: Any) -> None:
        """vLLM's ``tokenizer``, ``tensor_parallel_size``, ``pipeline_parallel_size``, ``trust_remote_code`` and
        ``disable_log_stats`` are taken where they ask for what pdpool does anyway (the model's own tokenizer, one
        device, no stats logged here); another value is a ValueError naming it."""
        if tokenizer is not None and tokenizer != model:
            raise ValueError(f"tokenizer={tokenizer!r}: pdpool reads the model's own tokenizer (leave it unset)")
        for name, size in (("tensor_parallel_size", tensor_parallel_size),
                           ("pipeline_parallel_size", pipeline_parallel_size)):
            if size != 1:
                raise ValueError(f"{name}={size!r}: a pdpool engine runs on one device (scale out with more nodes)")
        for name, flag in (("trust_remote_code", trust_remote_code), ("disable_log_stats", disable_log_stats)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a boolean, got {short_repr(flag)}")
        self.config = config.build(model=model, dtype=dtype, **settings)
        self.engine = LLMEngine(self.config)
        path = self.engine.model_path
        self.frontend = Frontend(ModelFiles.read(path), Tokenizer(path, self.config.model.chat_template))
        self.engine.set_tokenizer_eos(self.tokenizer.eos_token_id)
        Grammars.of(self.frontend)
        self.generation_defaults = generation_defaults(path, self.config.model)
        self.output_processor = OutputProcessor(self.frontend.tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    def get_tokenizer(self) -> HFTokenizerView:
        """The tokenizer, called as vLLM's (``HFTokenizerView``: ``encode``, ``decode``, ``eos_token_id``,
        ``apply_chat_template(..., tokenize=False)``)."""
        return HFTokenizerView(self.tokenizer)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request: None = None,
                 priority: int | Sequence[int] | None = None, tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[GenerationResult]:
        """Run every prompt to completion; one result per prompt, in input order. ``use_tqdm``: a bool, or a
        callable making the progress bar (``functools.partial(tqdm, leave=False)``), as vLLM's."""
        _unset_only(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {short_repr(prompts)}")
        parsed = [parse_prompt(p) for p in prompts]
        params_list = self._params_for(sampling_params, len(parsed), lora_request)
        return self._run([(shown, prompt, p, True) for (shown, prompt), p in zip(parsed, params_list)], use_tqdm,
                         self._priorities(priority, len(parsed)))

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: None = None,
             priority: int | Sequence[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[GenerationResult]:
        """One conversation (a list of messages) or a list of them, each rendered with the chat template; a list
        of results, one per conversation, as vLLM's (its arguments in its order). A message's content reaches the
        template as a string (``chat_template_content_format`` "auto" or "string"; vLLM's "openai", a list of
        parts, is refused)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={short_repr(chat_template_content_format)}: pdpool "
                             "renders each message's content as a string ('auto' or 'string')")
        _unset_only(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of messages or a list of such lists, got "
                            f"{short_repr(messages)}")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        params_list = self._params_for(sampling_params, len(conversations), lora_request)
        rendered = [self.frontend.render_chat(chat_messages(conv), add_generation_prompt, continue_final_message,
                                              tools, chat_template, chat_template_kwargs) for conv in conversations]
        return self._run([(text, text, p, False) for text, p in zip(rendered, params_list)], use_tqdm,
                         self._priorities(priority, len(conversations)))

    def beam_search(self, *args: Any, **kwargs: Any) -> list:
        """vLLM's ``beam_search``: the offline ``LLM`` has none (the server's ``use_beam_search`` has)."""
        raise NotImplementedError("pdpool's offline LLM has no beam search: use generate with SamplingParams "
                                  "(temperature=0 for greedy, n > 1 for several samples), or a server's "
                                  "use_beam_search")

    def encode(self, *args: Any, **kwargs: Any) -> list:
        """vLLM's pooling calls (``encode``, ``embed``, ``classify``, ``score``) on a generative model: vLLM's
        ValueError."""
        raise ValueError(_POOLING_ONLY.format("encode"))

    def embed(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(_POOLING_ONLY.format("embed"))

    def classify(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(_POOLING_ONLY.format("classify"))

    def score(self, *args: Any, **kwargs: Any) -> list:
        raise ValueError(_POOLING_ONLY.format("score"))

    def _priorities(self, priority, count: int) -> list[int]:
        """Each prompt's priority (lower runs first, as vLLM's): taken with ``LLM(scheduling_policy="priority")``;
        under the default first come, first served, a nonzero one is refused rather than ignored."""
        priorities = [0] * count if priority is None else _per_prompt("priority", priority, count, int)
        if any(priorities) and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority {short_repr(priority)}: this LLM schedules first come, first served; "
                             "LLM(..., scheduling_policy='priority') takes priorities")
        return priorities

    def _params_for(self, sampling_params, count: int, lora_request) -> list[SamplingParams]:
        """The params of each of ``count`` prompts; vLLM's arguments pdpool has not are refused here, at the call."""
        if lora_request is not None:
            raise ValueError("lora_request: pdpool does not serve LoRA adapters")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        # a copy of each: the front end fills bad_words_token_ids and grammar on it, not on the caller's (vLLM clones)
        copies: dict[int, SamplingParams] = {}
        out = []
        for params in _per_prompt("sampling_params", sampling_params, count, SamplingParams):
            if id(params) not in copies:
                copies[id(params)] = copy.copy(params)
            out.append(copies[id(params)])
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without params, as vLLM's: the model's generation defaults
        (``--generation-config``; max_tokens 16 unless they give max_new_tokens)."""
        d = self.generation_defaults
        max_tokens = d.max_tokens or 16
        if d.max_tokens_cap is not None:
            max_tokens = min(max_tokens, d.max_tokens_cap)
        return SamplingParams(**d.sampling, max_tokens=max_tokens)

    def _run(self, requests: list[tuple[str | None, str | list[int], SamplingParams, bool]],
             use_tqdm: bool | Callable[..., Any], priorities: list[int]) -> list[GenerationResult]:
        """``requests``: (the prompt the output shows, what to encode, params, add_special_tokens); ``priorities``:
        one per request."""
        ids: list[str] = []
        groups: list[list[str]] = []   # each prompt's n choices (n engine requests), in choice order
        try:
            for (shown, prompt, params, add_special_tokens), priority in zip(requests, priorities):
                token_ids = self.frontend.encode_prompt(prompt, add_special_tokens)
                kept = self.frontend.apply_prompt_options(token_ids, params, self.engine.max_model_len)
                if len(kept) < len(token_ids):
                    token_ids, shown = kept, None
                groups.append([])
                for j in range(params.n):
                    rid = f"offline-{next(self._ids)}"
                    choice = params if params.n == 1 else params.for_choice(j)
                    # only the finished outputs are read here: no per-step outputs or text (see OutputProcessor)
                    self.engine.add_request(rid, token_ids, choice, priority=priority, final_only=True)
                    ids.append(rid)
                    groups[-1].append(rid)
                    self.output_processor.add(rid, shown, token_ids, choice, final_only=True)
            results = dict(zip(ids, self._drain(ids, use_tqdm)))
        except BaseException:
            for rid in ids:
                self.output_processor.forget(rid)
            self.engine.abort_request(ids)
            raise
        return [GenerationResult.from_final([results[rid] for rid in group],
                                            self.tokenizer if request[2].detokenize else None)
                for group, request in zip(groups, requests)]

    def _drain(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(ids), desc="generate", unit="req",
                                                             dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                results, stopped = self.output_processor.process(self.engine.step())
                if stopped:
                    self.engine.abort_request(stopped)
                for out in results:
                    # a request the engine failed alone is finished, with finish_reason "error" (vLLM's: the
                    # engine logged why), and its batch-mates' results are kept
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(final) < len(ids):
                    missing = [i for i in ids if i not in final]
                    raise RuntimeError(f"the engine dropped requests {missing}")
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]
