"""`moeshard.moe.model.kda` against transformers' kimi_linear KDA layer
(`KimiLinearDeltaAttention`).

The fixture (`tools/make_kda_fixture.py`, transformers 5.24.0, float32) holds one layer's
weights, 9 input tokens, transformers' output for the whole sequence at once (its chunked
form) and token by token with a cache (its recurrent form), and that cache afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ROOT

from moeshard.moe.model.kda import KdaState, KdaWeights, kda_forward

FIXTURE = ROOT / "tests" / "fixtures" / "kda" / "kimi_linear_kda.npz"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIXTURE))


def weights(ref) -> KdaWeights:
    w = {k[2:]: v for k, v in ref.items() if k.startswith("w.")}
    heads = w["forget_gate.A_log"].size
    m = KdaWeights.matrix
    return KdaWeights(
        q=m(w["q_proj.weight"]),
        k=m(w["k_proj.weight"]),
        v=m(w["v_proj.weight"]),
        f=KdaWeights.chain(
            m(w["forget_gate.f_a_proj.weight"]), m(w["forget_gate.f_b_proj.weight"])
        ),
        b=m(w["b_proj.weight"]),
        g=KdaWeights.chain(m(w["g_a_proj.weight"]), m(w["g_b_proj.weight"])),
        o=m(w["o_proj.weight"]),
        conv=w["conv1d.weight"][:, 0, :],
        dt_bias=w["forget_gate.dt_bias"],
        a_log=w["forget_gate.A_log"].reshape(heads),
        o_norm=w["o_norm.weight"],
        heads=heads,
        eps=1e-6,
    )


def close(got, want, rel=2e-6):  # measured: 5.3e-7 (outputs), 4.5e-7 (state)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= rel * scale, np.abs(got - want).max() / scale


def test_sequence_matches_transformers(ref):
    w = weights(ref)
    y = kda_forward(w, ref["x"], KdaState.empty(w.heads, w.head_dim, w.kernel))
    close(y, ref["prefill_y"])
    close(y, ref["step_y"])


def test_token_by_token_equals_the_whole_sequence_and_keeps_transformers_state(ref):
    w = weights(ref)
    whole = kda_forward(w, ref["x"], KdaState.empty(w.heads, w.head_dim, w.kernel))
    state = KdaState.empty(w.heads, w.head_dim, w.kernel)
    steps = np.concatenate([kda_forward(w, ref["x"][t : t + 1], state) for t in range(9)])
    close(steps, whole, rel=1e-6)  # the same recurrence; numpy's BLAS rounds T rows its own way
    close(state.s, ref["recurrent_state"])
    # transformers keeps the last `kernel` projections, the newest last; we keep kernel - 1
    np.testing.assert_allclose(state.conv_tail.T, ref["conv_state"][:, 1:], rtol=1e-6, atol=1e-6)


def test_state_carries_a_split_prefill(ref):
    """A prompt in two calls (5 tokens, then 4) gives what one call gives."""
    w = weights(ref)
    whole = kda_forward(w, ref["x"], KdaState.empty(w.heads, w.head_dim, w.kernel))
    state = KdaState.empty(w.heads, w.head_dim, w.kernel)
    parts = [kda_forward(w, ref["x"][:5], state), kda_forward(w, ref["x"][5:], state)]
    close(np.concatenate(parts), whole, rel=1e-6)
