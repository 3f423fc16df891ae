"""`moeshard.coordinator.sampling.adjust_logits` and `sample`: OpenAI's logit_bias, presence and
frequency penalties, checked against the definition written out token by token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeshard.coordinator.sampling import SamplingOptions, adjust_logits, sample

VOCAB = 50


def by_definition(logits, opts, generated):
    """OpenAI's formula, one token at a time: mu[j] - c[j] * alpha_frequency -
    float(c[j] > 0) * alpha_presence, after the bias."""
    out = [float(x) for x in logits]
    for token, bias in opts.logit_bias:
        out[token] += bias
    for j in range(len(out)):
        c = sum(1 for t in generated if t == j)
        out[j] -= c * opts.frequency_penalty + (1.0 if c > 0 else 0.0) * opts.presence_penalty
    return np.array(out)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    generated=st.lists(st.integers(0, VOCAB - 1), max_size=30),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
)
def test_penalties_and_bias_as_openai_defines_them(seed, generated, presence, frequency, bias):
    logits = np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)  # [V]
    opts = SamplingOptions(
        presence_penalty=presence, frequency_penalty=frequency, logit_bias=tuple(bias.items())
    )
    got = adjust_logits(logits, opts, generated)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, by_definition(logits, opts, generated), rtol=1e-5, atol=1e-4)
    assert np.array_equal(logits, np.random.default_rng(seed).standard_normal(VOCAB).astype(
        np.float32))  # fmt: skip  # (the caller's logits are left as they were)


def test_no_penalty_leaves_the_logits_alone():
    logits = np.arange(VOCAB, dtype=np.float32)
    assert adjust_logits(logits, SamplingOptions(), [3, 3, 4]) is logits


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_greedy_sampling_avoids_what_it_made_under_a_penalty(penalty):
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[7], logits[9] = 1.0, 0.5  # 7 is the best, 9 the next
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingOptions(), rng, [7, 7]) == 7
    assert sample(logits, SamplingOptions(**{penalty: 1.0}), rng, [7, 7]) == 9
    assert sample(logits, SamplingOptions(**{penalty: 1.0}), rng, [9]) == 7
    forced = SamplingOptions(logit_bias=((3, 100.0),))
    assert sample(logits, forced, rng, []) == 3
