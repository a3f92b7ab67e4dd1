import pytest

from pdpool.engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 0, 1.0, 1.0, 0, 0.0)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.n, p.seed) == ([], [], None, 1, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"temperature": 0.0, "top_k": 5}, True),
    ({"temperature": 0.7}, False), ({"top_k": -1}, False), ({"top_k": 2}, False),
])
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize("param, value, allowed", [
    ("n", 0, "[1, inf)"),
    ("max_tokens", 0, "[1, inf)"),
    ("min_tokens", -1, "[0, 16]"),
    ("min_tokens", 17, "at most max_tokens"),
    ("temperature", -0.1, "[0.0, 2.0]"),
    ("temperature", 2.5, "[0.0, 2.0]"),   # vLLM 0.32's bound
    ("temperature", float("nan"), "a number"),
    ("top_p", 0.0, "(0.0, 1.0]"),
    ("top_p", 1.5, "(0.0, 1.0]"),
    ("top_k", -2, "[-1, inf)"),
    ("top_k", 2.5, "an integer"),
    ("min_p", 1.1, "[0.0, 1.0]"),
    ("seed", "7", "an integer"),
    ("repetition_penalty", 0.0, "(0.0, inf)"),   # vLLM's: any positive finite one
    ("presence_penalty", -2.5, "[-2.0, 2.0]"),
    ("frequency_penalty", 3, "[-2.0, 2.0]"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", -1, "[0, 20]"),
    ("stop", [""], "non-empty"),
    ("stop_token_ids", [-3], "[0, inf)"),
    ("ignore_eos", "yes", "boolean"),
])
def test_validation_names_the_param_value_and_range(param, value, allowed):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{param: value})
    assert err.value.param == param
    assert isinstance(err.value, ValueError)
    shown = value[0] if isinstance(value, list) else value
    message = str(err.value)
    assert message.startswith(param) and allowed in message and repr(shown) in message


def test_validate_after_mutation():
    p = SamplingParams(max_tokens=None, min_tokens=100, logprobs=20, seed=0)
    p.top_p = 2.0
    with pytest.raises(SamplingParamsError, match=r"top_p must be in \(0.0, 1.0\], got 2.0") as err:
        p.validate()
    assert err.value.param == "top_p"


# ---- the edge check: nothing it passes can break the sampler ------------------------------------

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("param", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10 ** 400, -(10 ** 400), "1", None,
                                   [1.0]], ids=["nan", "inf", "-inf", "int1e400", "-int1e400", "str", "None", "list"])
def test_every_float_field_refuses_non_finite_and_non_numbers(param, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{param: value})
    assert err.value.param == param
    assert len(str(err.value)) < 300


def test_temperature_is_at_most_2_as_vllms_and_a_tiny_one_is_greedy():
    with pytest.raises(SamplingParamsError, match=r"\[0.0, 2.0\]") as err:
        SamplingParams(temperature=1e39)
    assert err.value.param == "temperature"
    assert SamplingParams(temperature=2.0).is_greedy is False
    assert SamplingParams(temperature=1e-300).is_greedy  # 1/T would overflow: vLLM treats T < 1e-5 as greedy
    assert SamplingParams(temperature=1e-5).is_greedy is False


@pytest.mark.parametrize("seed, ok", [
    (0, True), (-2, True), (-(2 ** 63), True), (2 ** 63 - 1, True),  # vLLM's range: torch.long, negatives included
    (2 ** 63, False), (-(2 ** 63) - 1, False), (10 ** 29, False), (1.0, False), (True, False),
])
def test_seed_fits_a_torch_generator(seed, ok):
    if ok:   # (-1 is vLLM's "no seed": tests/engine/test_offline_vllm_port.py)
        assert SamplingParams(seed=seed).seed == seed
        return
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(seed=seed)
    assert err.value.param == "seed"


def test_stop_token_ids_are_checked_against_the_vocabulary_when_it_is_known():
    p = SamplingParams(stop_token_ids=[0, 99, 100])
    p.validate(vocab_size=101)
    with pytest.raises(SamplingParamsError, match=r"\[0, 99\] \(the vocabulary's ids\), got 100") as err:
        p.validate(vocab_size=100)
    assert err.value.param == "stop_token_ids"


@pytest.mark.parametrize("param, value", [
    ("stop", 5), ("stop", {"a": 1}), ("stop", [None]), ("stop_token_ids", 5), ("stop_token_ids", "12"),
    ("stop_token_ids", [1.5]), ("stop_token_ids", [True]), ("max_tokens", 2.0), ("min_tokens", None),
    ("top_k", 10 ** 30 + 0.5), ("logprobs", 1.5), ("skip_special_tokens", 1),   # logprobs=True is 1 (vLLM)
])
def test_wrong_types_are_sampling_params_errors(param, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{param: value})
    assert err.value.param == param


def test_error_messages_cut_huge_values_short():
    for kwargs in ({"seed": 10 ** 5000}, {"stop": ["x" * 10 ** 6, ""]}, {"temperature": -(10 ** 5000)},
                   {"stop_token_ids": [-(10 ** 5000)]}):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kwargs)
        assert len(str(err.value)) < 300
