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
    ("n", 2, "only n=1"),
    ("max_tokens", 0, "[1, inf)"),
    ("min_tokens", -1, "[0, 16]"),
    ("min_tokens", 17, "at most max_tokens"),
    ("temperature", -0.1, "[0.0, inf)"),
    ("temperature", float("nan"), "a number"),
    ("top_p", 0.0, "(0.0, 1.0]"),
    ("top_p", 1.5, "(0.0, 1.0]"),
    ("top_k", -2, "[-1, inf)"),
    ("top_k", 2.5, "an integer"),
    ("min_p", 1.1, "[0.0, 1.0]"),
    ("seed", "7", "an integer"),
    ("repetition_penalty", 0.0, "(0.0, 2.0]"),
    ("repetition_penalty", 2.5, "(0.0, 2.0]"),
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
