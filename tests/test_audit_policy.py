"""The audit policy written once (`coordinator/remote/policy.py`): the vetting rule, the base
rate, and the byte budget's factor; and the decode core's rollback rules
(`coordinator/decode.py`) with a verifier that names the step to undo."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.coordinator.decode import Decoder
from moeshard.coordinator.remote.policy import AUDIT_RATE, VETTING_AUDITS, AuditBudget, rate_for
from moeshard.coordinator.runtime import open_local
from moeshard.coordinator.sampling import SamplingOptions


def test_new_and_suspect_nodes_are_audited_on_every_call():
    assert rate_for(AUDIT_RATE, VETTING_AUDITS, 0, False) == 1.0
    assert rate_for(AUDIT_RATE, VETTING_AUDITS, VETTING_AUDITS - 1, False) == 1.0
    assert rate_for(AUDIT_RATE, VETTING_AUDITS, VETTING_AUDITS, False) == AUDIT_RATE
    assert rate_for(AUDIT_RATE, VETTING_AUDITS, 10_000, True) == 1.0
    assert rate_for(0.0, VETTING_AUDITS, 0, True) == 0.0  # audits off means off


def test_the_budget_scales_every_pick_to_the_cap():
    """At 4 MB fetched per token against a 1 MB cap, the factor settles near 1/4, and the
    bytes fetched per token (which shrink with it) settle near the cap."""
    budget = AuditBudget(bytes_per_token=1e6)
    for _ in range(2000):
        budget.token(4e6 * budget.factor)  # what audits fetch scales with their rate
    assert budget.factor == pytest.approx(0.25, rel=0.05)
    budget.token(0.0)
    assert budget.factor < 1  # one token without fetches does not lift it
    free = AuditBudget()  # no cap: always 1
    free.token(1e12)
    assert free.factor == 1.0


class _Verifier:
    """A verifier that says: step `back` used a lie (once), and what is settled."""

    def __init__(self, back=None, settled=10**9):
        self.step, self.back, self.settled = 0, back, settled
        self.undone, self.forgotten = [], []

    def begin_step(self, step):
        self.step = step

    def rollback_step(self):
        back, self.back = self.back, None
        return back

    def undo(self, step):
        self.undone.append(step)

    def settled_step(self):
        return self.settled

    def forget_before(self, step):
        self.forgotten.append(step)

    def tokens(self, n):
        pass


@pytest.fixture(scope="module")
def demo(demo):
    """The session's demo model, open (this module's own: its tests run it)."""
    return open_local(demo).transformer


def _run(decoder, seq, steps):
    for _ in range(steps):
        decoder.step([(seq, seq.pending)])


def test_a_rollback_keeps_shown_tokens_unless_it_may_retract(demo):
    """Undo from step 3: with `retract` every token from there is made again (the same ones,
    the sampler's state restored); without, the shown tokens stay and only the rest go."""
    opts = SamplingOptions(max_tokens=12, temperature=0.8, seed=3)
    verifier = _Verifier()
    decoder = Decoder(demo, verifier)
    seq = decoder.start([1, 5, 9], opts)
    _run(decoder, seq, 8)
    first = list(seq.tokens)
    steps = list(seq.token_steps)
    verifier.back = steps[3]
    assert decoder.rollback([seq], retract=True) == ([seq], [])
    assert seq.tokens == first[:3] and verifier.undone == [steps[3]]
    _run(decoder, seq, 5)
    assert seq.tokens == first  # the sampler's state was restored with the cache
    seq.shown = 6
    verifier.back = steps[3]
    assert decoder.rollback([seq], retract=False) == ([seq], [])
    assert seq.tokens == first[:6]  # no retraction: back to the first unshown token only
    seq.shown = len(seq.tokens)
    verifier.back = steps[3]
    assert decoder.rollback([seq], retract=False) == ([], [])  # all shown: nothing undone


def test_settled_tokens_and_what_can_be_forgotten(demo):
    verifier = _Verifier(settled=0)
    decoder = Decoder(demo, verifier)
    seq = decoder.start([4, 2], SamplingOptions(max_tokens=6))
    _run(decoder, seq, 4)
    verifier.settled = seq.token_steps[1]
    assert decoder.settled(seq) == 2
    seq.shown = 2
    decoder.forget([seq], retract=False)
    assert verifier.forgotten[-1] == seq.token_steps[2]  # the pass making token 2 may be undone
    decoder.forget([], retract=False)
    assert verifier.forgotten[-1] == decoder.step_no  # nothing running: nothing to undo
    assert np.all(np.diff(seq.token_steps) == 1)
