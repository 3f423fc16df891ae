"""Holder choice is greedy; `experts._give_trial` gives a node with few calls one expert of a
layer now and then, so a new node gets work (and, in its vetting, an audit of every call): CI
once saw a liar get no call in three generations and prove nothing."""

from moeshard.coordinator.remote import experts
from moeshard.coordinator.remote.peers import Peer
from moeshard.coordinator.remote.transport import PeerSpec


def peer(addr: str, calls: int) -> Peer:
    return Peer(PeerSpec(addr, ""), calls=calls)


def test_a_new_holder_gets_one_expert_on_trial_and_a_tried_one_does_not():
    old, new = peer("a:1", 500), peer("b:1", 0)
    options = {e: [old, new] for e in range(4)}
    chosen = dict.fromkeys(range(4), old)
    experts._give_trial(chosen, options, share=1.0)
    assert sorted(p.addr for p in chosen.values()) == ["a:1"] * 3 + ["b:1"]
    new.calls = experts.TRIAL_CALLS  # tried enough: no more trials
    chosen = dict.fromkeys(range(4), old)
    experts._give_trial(chosen, options, share=1.0)
    assert all(p is old for p in chosen.values())


def test_trials_come_at_about_the_share_and_never_at_zero():
    old, new = peer("a:1", 500), peer("b:1", 0)
    options = {0: [old, new]}
    given = 0
    for _ in range(4000):
        chosen = {0: old}
        experts._give_trial(chosen, options, share=0.05)
        given += chosen[0] is new
    assert 120 < given < 290  # 200 expected (binomial: sd 14)
    chosen = {0: old}
    experts._give_trial(chosen, options, share=0.0)
    assert chosen[0] is old
