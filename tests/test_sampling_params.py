"""SamplingParams refuses every bad value by field name, and normalizes what it accepts."""

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)

NOT_FINITE = (math.nan, math.inf, -math.inf)


def refused(field: str, **fields: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**fields)
    assert caught.value.param == field
    assert field in caught.value.message
    return caught.value


def test_defaults_are_the_documented_ones():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, -1, 1.0, 0.0)
    assert (p.seed, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (None, 0, (), (), False)
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty) == (None, 0.0, 0.0)
    assert (p.repetition_penalty, p.logit_bias) == (1.0, ())
    assert (p.typical_p, p.top_n_sigma) == (1.0, -1.0)  # both off


def test_module_imports_without_torch():
    code = "import sys, nanoserve.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_message_names_field_value_and_range():
    error = refused("temperature", temperature=-0.5)
    assert "-0.5" in error.message and ">= 0" in error.message


@pytest.mark.parametrize("value", [-0.01, -1, *NOT_FINITE, "1", None, True])
def test_temperature_refuses_negative_non_finite_and_non_numbers(value):
    refused("temperature", temperature=value)


@pytest.mark.parametrize("value", [0.0, 0, -0.0, 1e-9, 2.0, 100])
def test_temperature_accepts_any_finite_non_negative_number(value):
    assert SamplingParams(temperature=value).temperature == value


@pytest.mark.parametrize("value", [0.0, -0.1, 1.0001, 2, *NOT_FINITE, True])
def test_top_p_refuses_values_outside_zero_exclusive_one_inclusive(value):
    refused("top_p", top_p=value)


@pytest.mark.parametrize("value", [-2, 1.5, 2.0, True, False, "3"])
def test_top_k_refuses_anything_but_minus_one_zero_or_a_positive_int(value):
    refused("top_k", top_k=value)


def test_top_k_zero_is_no_limit_as_in_vllm():
    assert not SamplingParams(top_k=0).is_greedy
    SamplingParams(top_k=0, temperature=0.8)  # accepted


@pytest.mark.parametrize("value", [-0.01, 1.01, *NOT_FINITE])
def test_min_p_refuses_values_outside_zero_one(value):
    refused("min_p", min_p=value)


@pytest.mark.parametrize("value", [0, -0.01, 1.01, True, "0.5", *NOT_FINITE])
def test_typical_p_refuses_values_outside_zero_exclusive_to_one(value):
    refused("typical_p", typical_p=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, -2, True, "1", *NOT_FINITE])
def test_top_n_sigma_refuses_anything_but_minus_one_or_a_positive_number(value):
    refused("top_n_sigma", top_n_sigma=value)


@pytest.mark.parametrize("value", [-1, -1.0, 1e-6, 1, 1.5, 30.0])
def test_top_n_sigma_accepts_minus_one_for_off_and_any_positive_number(value):
    assert SamplingParams(top_n_sigma=value).top_n_sigma == value


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "16"])
def test_max_tokens_refuses_non_positive_and_non_int(value):
    refused("max_tokens", max_tokens=value)


@pytest.mark.parametrize("value", [-1, 17, 2.0, True])
def test_min_tokens_refuses_negative_non_int_or_above_max_tokens(value):
    refused("min_tokens", min_tokens=value, max_tokens=16)


@pytest.mark.parametrize("value", [-1, 21, 1.0, True])
def test_logprobs_refuses_values_outside_zero_to_twenty(value):
    refused("logprobs", logprobs=value)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.01, 2.01, *NOT_FINITE, True])
def test_presence_and_frequency_penalties_refuse_values_outside_minus_two_two(field, value):
    refused(field, **{field: value})


@pytest.mark.parametrize("value", [0.0, -1.0, 2.01, 1e-40, 0.0099, *NOT_FINITE, True])
def test_repetition_penalty_refuses_values_outside_a_hundredth_to_two(value):
    refused("repetition_penalty", repetition_penalty=value)


def test_a_repetition_penalty_of_a_hundredth_is_accepted():
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


def test_logit_bias_refuses_more_tokens_than_the_cap_and_takes_the_cap():
    assert len(SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS), 1.0)).logit_bias) \
        == MAX_LOGIT_BIAS_TOKENS
    refused("logit_bias", logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS + 1), 1.0))


def test_stop_takes_the_caps_on_count_and_total_length_and_refuses_one_more():
    at_count = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    at_length = ["x" * (MAX_STOP_CHARS - 1), "y"]
    assert SamplingParams(stop=at_count).stop == tuple(at_count)
    assert SamplingParams(stop=at_length).stop == tuple(at_length)
    refused("stop", stop=[*at_count, "one more"])
    refused("stop", stop=[*at_length, "z"])


@pytest.mark.parametrize("value", [-1, 2**63, 1.0, True, "7"])
def test_seed_refuses_values_outside_int64_non_negative(value):
    refused("seed", seed=value)


@pytest.mark.parametrize("value", [{1: 100.5}, {1: -101}, {-1: 1.0}, {True: 1.0}, {1: math.nan},
                                   {1: True}, {"1": 1.0}, [(1, 1.0), (1, 2.0)], 5, "ab"])
def test_logit_bias_refuses_bad_ids_out_of_range_values_and_duplicates(value):
    refused("logit_bias", logit_bias=value)


@pytest.mark.parametrize("value", [[-1], [1.0], [True], "12", 3])
def test_stop_token_ids_refuses_non_token_ids(value):
    refused("stop_token_ids", stop_token_ids=value)


@pytest.mark.parametrize("value", [[""], [1], 3, {"a": 1}])
def test_stop_refuses_non_strings_and_empty_strings(value):
    refused("stop", stop=value)


def test_ignore_eos_refuses_non_bool():
    refused("ignore_eos", ignore_eos=1)


def test_containers_are_normalized_to_sorted_hashable_tuples():
    p = SamplingParams(stop="END", stop_token_ids=[7, 3], logit_bias={9: 1, 2: -3.5})
    assert p.stop == ("END",)
    assert p.stop_token_ids == (7, 3)
    assert p.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(p) == hash(SamplingParams(stop=["END"], stop_token_ids=(7, 3),
                                          logit_bias=[(9, 1.0), (2, -3.5)]))


def test_is_greedy_means_temperature_zero_or_top_k_one():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.01, top_k=2).is_greedy




def test_a_temperature_too_small_to_divide_logits_by_is_greedy():
    assert SamplingParams(temperature=MIN_TEMPERATURE / 10).is_greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).is_greedy


def test_choice_j_draws_with_seed_plus_j_and_only_choice_0_scores_the_prompt():
    params = SamplingParams(seed=41, prompt_logprobs=2, temperature=0.8)
    assert params.for_choice(0) is params
    assert [(c.seed, c.prompt_logprobs) for c in map(params.for_choice, (1, 2))] == [(42, None), (43, None)]
    assert params.for_choice(2) == SamplingParams(seed=43, temperature=0.8)
    unseeded = SamplingParams(prompt_logprobs=0).for_choice(3)
    assert (unseeded.seed, unseeded.prompt_logprobs) == (None, None)


def test_a_choice_whose_seed_would_pass_2_to_the_63_is_refused_naming_the_seed():
    params = SamplingParams(seed=2**63 - 2)
    assert params.for_choice(1).seed == 2**63 - 1
    with pytest.raises(InvalidRequestError) as caught:
        params.for_choice(2)
    assert caught.value.param == "seed"


def test_validate_for_vocab_refuses_ids_outside_the_vocabulary():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    assert caught.value.param == "logit_bias" and "100" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(stop_token_ids=[5, 250]).validate_for_vocab(100)
    assert caught.value.param == "stop_token_ids" and "250" in caught.value.message


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(temperature=st.floats(0, 1e6), top_p=st.floats(0, 1, exclude_min=True),
       min_p=st.floats(0, 1), top_k=st.one_of(st.just(-1), st.integers(1, 10**6)),
       penalty=st.floats(-2, 2), repetition=st.floats(MIN_REPETITION_PENALTY, 2),
       seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)), logprobs=st.integers(0, 20))
def test_every_value_inside_the_ranges_is_accepted(temperature, top_p, min_p, top_k, penalty,
                                                   repetition, seed, logprobs):
    SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                   presence_penalty=penalty, frequency_penalty=penalty,
                   repetition_penalty=repetition, seed=seed, logprobs=logprobs)


@given(st.sampled_from(["top_p", "typical_p", "min_p", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "temperature"]),
       st.one_of(finite, st.sampled_from(NOT_FINITE)))
def test_every_float_field_accepts_exactly_its_range(field, value):
    ranges = {"top_p": (0, 1, True), "typical_p": (0, 1, True), "min_p": (0, 1, False),
              "presence_penalty": (-2, 2, False),
              "frequency_penalty": (-2, 2, False), "repetition_penalty": (MIN_REPETITION_PENALTY, 2, False),
              "temperature": (0, math.inf, False)}
    low, high, open_low = ranges[field]
    inside = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if inside:
        SamplingParams(**{field: value})
    else:
        refused(field, **{field: value})


@given(st.integers(-5, 40), st.integers(1, 40))
def test_min_tokens_is_accepted_exactly_between_zero_and_max_tokens(min_tokens, max_tokens):
    if 0 <= min_tokens <= max_tokens:
        SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens)
    else:
        refused("min_tokens", min_tokens=min_tokens, max_tokens=max_tokens)
