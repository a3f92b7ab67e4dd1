"""Structured output: JSON schemas, JSON mode, regular expressions, choices, grammars and structural tags, enforced
token by token.

A request's constraint (vLLM's ``structured_outputs``, or OpenAI's ``response_format``) is compiled by the front
end, once per distinct constraint, into an llguidance grammar (``Grammars.compile``; a bad schema or regex is an
``InvalidRequestError`` naming the request's field, before the engine sees the request). The model runner keeps
one ``RowMatcher`` per request, made on its first sampling step. Each step, before the draw::

    matcher.advance(output ids)   consume the ids sampled since the last step (the first one may come from a
                                  prefill node): a rejected id fails that request alone
    matcher.fill(bitmask row)     the ids the grammar allows next, one bit each (EOS only once it is complete)

and the sampler sets every other logit of the row to -inf (``mask_rows``). The grammar is checked against the
request's real output ids, never a placeholder: the engine waits for a step's ids before it samples such a row
(``SamplingParams.reads_output``). llguidance computes a mask lazily from the parser's state (an Earley parser
over the tokenizer's trie): tens of µs to about a millisecond per row and step on this machine's CPU.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from pdpool.engine.sampling_params import SamplingParamsError, short_repr

# One constraint per request; vLLM's ``StructuredOutputsParams`` names. ``json_object``: any JSON object.
# ``structural_tag``: free text in which each trigger starts a tagged segment (begin, JSON of a schema, end).
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's options beside the constraint: taken (the one that changes the grammar is ``disable_any_whitespace``).
OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties", "whitespace_pattern")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its ``value`` (a JSON schema as an
    object or text; a regex; a list of strings; a Lark or GBNF grammar; True). ``param`` is the request field it
    came from, named in errors (``structured_outputs``, ``response_format``, ``guided_json``...)."""

    kind: str
    value: object
    compact_json: bool = False        # vLLM's disable_any_whitespace: no whitespace between JSON tokens
    param: str = "structured_outputs"

    @classmethod
    def parse(cls, raw, param: str = "structured_outputs") -> "StructuredOutputs":
        """From vLLM's ``structured_outputs`` object (or a ``StructuredOutputs``); ``SamplingParamsError`` naming
        ``param`` when it is not exactly one valid constraint."""
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise SamplingParamsError(param, f"{param} must be an object with one of {', '.join(KINDS)}, got "
                                      f"{short_repr(raw)}")
        unknown = sorted(set(raw) - set(KINDS) - set(OPTIONS))
        if unknown:
            raise SamplingParamsError(param, f"{param} has unknown fields {unknown}: it takes one of "
                                      f"{', '.join(KINDS)}")
        given = [k for k in KINDS if raw.get(k) is not None and not (k == "json_object" and raw[k] is False)]
        if len(given) != 1:
            raise SamplingParamsError(param, f"{param} must set exactly one of {', '.join(KINDS)}, got "
                                      f"{given or 'none'}")
        kind = given[0]
        value = _checked(kind, raw[kind], f"{param}.{kind}" if param == "structured_outputs" else param)
        for option in OPTIONS:   # taken and checked; only disable_any_whitespace changes the grammar
            given_option = raw.get(option)
            if option not in raw or (option == "whitespace_pattern" and given_option is None):
                continue
            if not isinstance(given_option, str if option == "whitespace_pattern" else bool):
                raise SamplingParamsError(param, f"{param}.{option} must be a "
                                          f"{'string' if option == 'whitespace_pattern' else 'boolean'}, got "
                                          f"{short_repr(given_option)}")
        return cls(kind, value, bool(raw.get("disable_any_whitespace")), param)

    def key(self) -> str:
        """The constraint as text: compiled grammars are kept by it."""
        return json.dumps([self.kind, self.value, self.compact_json], sort_keys=True, separators=(",", ":"))


def _checked(kind: str, value, where: str):
    if kind == "structural_tag":
        return _structural_tag(value, where)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise SamplingParamsError(where, f"{where} is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise SamplingParamsError(where, f"{where} must be a JSON schema (an object), got {short_repr(value)}")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise SamplingParamsError(where, f"{where} must be a non-empty string, got {short_repr(value)}")
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise SamplingParamsError(where, f"{where} must be a non-empty list of non-empty strings, got "
                                      f"{short_repr(value)}")
        value = list(value)
    elif value is not True:   # json_object
        raise SamplingParamsError(where, f"{where} must be true, got {short_repr(value)}")
    return value


def _structural_tag(value, where: str) -> dict:
    """vLLM's structural tag (its guidance backend's shape), as JSON text or an object: ``{"structures": [{"begin",
    "schema", "end"}, ...], "triggers": [...]}``, each ``begin`` starting with one of the triggers. Returned with
    only those keys, each schema an object. xgrammar's newer ``{"format": ...}`` shape is refused, as vLLM's guidance
    backend refuses it (llguidance has no compiler for it). Errors name the request's field, as vLLM's do."""
    param = where.split(".", 1)[0]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise SamplingParamsError(param, f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SamplingParamsError(param, f"{where} must be an object with 'structures' and 'triggers', got "
                                  f"{short_repr(value)}")
    if "structures" not in value and "format" in value:
        raise SamplingParamsError(param, f"{where}: the 'format' shape of structural tags (xgrammar's) is not "
                                  "supported; send {\"structures\": [{\"begin\", \"schema\", \"end\"}], \"triggers\": "
                                  "[...]}")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise SamplingParamsError(param, f"{where}.triggers must be a list of non-empty strings, got "
                                  f"{short_repr(triggers)}")
    if not isinstance(structures, list) or not structures:
        raise SamplingParamsError(param, f"{where}.structures must be a non-empty list of {{\"begin\", \"schema\", "
                                  f"\"end\"}} objects, got {short_repr(structures)}")
    kept = []
    for i, tag in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(tag, dict) or not isinstance(tag.get("begin"), str) or not isinstance(tag.get("end"), str):
            raise SamplingParamsError(param, f"{at} must be an object with string 'begin' and 'end' and a 'schema', "
                                      f"got {short_repr(tag)}")
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise SamplingParamsError(param, f"{at}.begin {short_repr(tag['begin'])} starts with none of the "
                                      f"triggers {short_repr(triggers)}")
        if tag.get("schema") is None:
            raise SamplingParamsError(param, f"{at}.schema is required (a JSON schema)")
        try:
            schema = _checked("json", tag["schema"], f"{at}.schema")
        except SamplingParamsError as exc:
            raise SamplingParamsError(param, str(exc)) from None
        kept.append({"begin": tag["begin"], "schema": {} if schema is True else schema, "end": tag["end"]})
    return {"structures": kept, "triggers": list(triggers)}


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: what ``RowMatcher``s start from (shared by every request with the
    same constraint; read only)."""

    tokenizer: object   # llguidance.LLTokenizer
    grammar: str        # llguidance's grammar text
    vocab_size: int

    def matcher(self) -> "RowMatcher":
        return RowMatcher(self)


class Grammars:
    """The front end's grammar compiler: the llguidance tokenizer (made from the front end's ``tokenizer.json`` on
    first use, about 0.2 s for a 49k vocabulary) and the last ``capacity`` compiled constraints. ``Grammars.of``
    gives a ``Frontend`` its compiler."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, capacity: int = 256) -> None:
        """``tokenizer``: has ``to_json()`` (``pdpool.frontend.Tokenizer``)."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids or ())
        self.capacity = capacity
        self._tokenizer = None
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()   # the offline LLM and the server may compile from different threads

    @classmethod
    def of(cls, frontend) -> "Grammars":
        """Set (once) and return ``frontend.grammars``."""
        if frontend.grammars is None:
            frontend.grammars = cls(frontend.tokenizer, frontend.vocab_size, frontend.eos_token_ids)
        return frontend.grammars

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """``InvalidRequestError`` (param ``spec.param``) when the schema, regex or grammar does not compile."""
        from pdpool.frontend import InvalidRequestError
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            tokenizer = self._tokenizer
        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {spec.param}: {exc}", param=spec.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {spec.param}: {error.strip()}", param=spec.param)
        compiled = CompiledGrammar(tokenizer, grammar, self.vocab_size)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled


def _grammar_text(spec: StructuredOutputs) -> str:
    import llguidance

    if spec.kind in ("json", "json_object"):
        schema = _ANY_OBJECT if spec.kind == "json_object" else spec.value
        return _json_grammar(schema, spec.compact_json)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "structural_tag":   # each begin's trigger: the first that starts it, as vLLM picks
        triggers = spec.value["triggers"]
        return llguidance.StructTag.to_grammar([llguidance.StructTag(
            trigger=next(t for t in triggers if tag["begin"].startswith(t)), begin=tag["begin"], end=tag["end"],
            grammar=_tag_schema(tag["schema"], spec.compact_json)) for tag in spec.value["structures"]])
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    return llguidance.grammar_from("grammar", spec.value)   # Lark, or GBNF (converted)


def _json_grammar(schema, compact: bool) -> str:
    import llguidance

    if isinstance(schema, bool):   # JSON Schema's true (any value) and false (none)
        if not schema:
            raise ValueError("the schema false matches nothing")
        schema = {}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})


def _tag_schema(schema, compact: bool) -> dict:
    """A structural tag's schema as ``StructTag`` takes it: the schema itself, its whitespace rule inside. (vLLM's
    guidance backend hands it a compiled top-level grammar, which ``%json`` reads as a schema of unknown keywords:
    any JSON value. Its default backend, xgrammar, holds the schema, as this does.)"""
    if schema is False:
        raise ValueError("the schema false matches nothing")
    return {**(schema if isinstance(schema, dict) else {}), "x-guidance": {"whitespace_flexible": not compact}}


class RowMatcher:
    """One request's place in its grammar: the ids consumed so far, and the next allowed ids."""

    __slots__ = ("_matcher", "consumed", "vocab_size")

    def __init__(self, compiled: CompiledGrammar) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        self.consumed = 0
        self.vocab_size = compiled.vocab_size

    def advance(self, output_ids: list[int]) -> str | None:
        """Consume the ids of ``output_ids`` after those already consumed; the reason when the grammar rejects
        one (the request then fails), else None."""
        m = self._matcher
        for token in output_ids[self.consumed:]:
            if not m.consume_token(token):
                return f"structured output: the grammar stops at token id {token} ({_first_line(m.get_error())})"
            self.consumed += 1
        if m.is_error():
            return f"structured output: {_first_line(m.get_error())}"
        return None

    def fill(self, row) -> None:
        """The next allowed ids as bits into ``row`` [ceil(V/32)] int32 (contiguous, on the CPU)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends."""
    return error.strip().split("\n", 1)[0]


def param_of(params) -> str:
    """The request field that carried a row's constraint (errors name it)."""
    return getattr(params.structured_outputs, "param", "structured_outputs")


def mask_rows(processed, rows: list[int], matchers: list, output_token_ids: list[list[int]],
              failed: dict[int, str], params: list) -> None:
    """In place on ``processed`` [R, V] float32: each of ``rows`` keeps only the logits its grammar allows next. A
    row whose output its grammar rejects fails alone (``failed``); a failure is a ``RequestFault`` naming the
    request's field. The rows' masks are computed into one bitmask [G, ceil(V/32)] int32 on the host, uploaded as bits and unpacked on the logits' device, then one
    masked fill. (torch is imported here: the router reads this module's ``StructuredOutputs`` and never loads
    torch.)"""
    import torch

    from pdpool.engine.sampler import RequestFault

    vocab = processed.shape[1]
    words = (vocab + 31) // 32
    bits = _bitmask(len(rows), words)   # all ones: a failed row's (it is dropped anyway)
    ready = []
    for j, i in enumerate(rows):
        matcher = matchers[i]
        reason = matcher.advance(output_token_ids[i])
        if reason is None and matcher.vocab_size > vocab:   # the tokenizer knows ids the logits do not have
            reason = (f"structured output: the grammar's vocabulary ({matcher.vocab_size}) is larger than the "
                      f"model's logits ({vocab})")
        if reason is not None:
            failed.setdefault(i, RequestFault(reason, param_of(params[i])))
            continue
        ready.append((matcher, j))
    # One row after another, on this thread. llguidance's thread pool (LLExecutor) measured slower on an H200 host
    # (64 rows of JSON strings: 5.3 against 2.3 ms per step; its threads slowed even the plain steps after them),
    # and on a 2-core CPU it waits for the cores torch's threads hold (docs/performance.md, structured output).
    for matcher, j in ready:
        matcher.fill(bits[j])
    device = processed.device
    index = torch.tensor(rows, dtype=torch.long)
    if device.type == "cpu":   # numpy's unpackbits: 0.1-0.3 ms for 64 rows x 49k ids, the shifts below 30-40 ms
        import numpy as np

        allowed = torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab])
    else:   # the bits go up (G x V/8 bytes) and are unpacked there
        bits, index = bits.to(device, non_blocking=True), index.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = (bits.unsqueeze(-1) >> shifts) & 1
    allowed = allowed.view(len(rows), -1)[:, :vocab].bool()   # [G, V]
    processed[index] = processed[index].masked_fill(~allowed, float("-inf"))


_BITMASKS = threading.local()   # per engine thread: (rows, words) -> a host buffer (a fresh one page-faults)


def _bitmask(rows: int, words: int):
    """A [rows, words] int32 host buffer of this thread, set to all ones. Reusing it is safe: a step's bits are
    consumed (unpacked, or uploaded: from pageable memory the copy is done when ``to`` returns) before the thread's
    next step fills them."""
    import torch

    kept = getattr(_BITMASKS, "buffers", None)
    if kept is None:
        kept = _BITMASKS.buffers = {}
    buf = kept.get((rows, words))
    if buf is None:
        if len(kept) > 64:
            kept.clear()
        buf = kept[(rows, words)] = torch.empty(rows, words, dtype=torch.int32)
    return buf.fill_(-1)
