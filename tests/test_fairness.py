"""The node's fair shares (node/fairness.py): start-time fair queuing by address then key,
longest-queue drop, and flows read from grpc peer strings."""

from __future__ import annotations

import threading

import pytest
from helpers import wait_until

from moeshard.node.fairness import Busy, FairGate, Flow, flow_of, largest_flow

HOME = "10.0.0.1"


def _queue(gate: FairGate, flow: Flow, cost: float, order: list, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            with gate.hold(flow, cost, 10):
                order.append(flow.key)
        except Busy as exc:
            errors.append((flow.key, str(exc)))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _held(gate: FairGate, flow: Flow, cost: float):
    """A holder of the gate's only place until the returned event is set."""
    release, holding = threading.Event(), threading.Event()

    def run() -> None:
        with gate.hold(flow, cost, 10):
            holding.set()
            release.wait()

    thread = threading.Thread(target=run)
    thread.start()
    holding.wait(5)
    return release, thread


def _release(release: threading.Event, holder: threading.Thread, threads) -> None:
    """Let the holder go and wait for every queued request to have had its turn."""
    release.set()
    for t in [holder, *threads]:
        t.join()


def test_a_small_client_goes_before_a_greedy_one_s_backlog():
    """A greedy key has three large requests queued behind its own running one; an honest
    key's one-row request, queued last, is let in first (its tag is the virtual time)."""
    gate = FairGate(slots=1, queue=8)
    greedy, honest = Flow(HOME, "greedy"), Flow(HOME, "honest")
    release, holder = _held(gate, greedy, 7800)
    order, errors, threads = [], [], []
    for _ in range(3):
        threads.append(_queue(gate, greedy, 7800, order, errors))
    wait_until(lambda: len(gate.waiting) == 3, 5, what="the greedy backlog")
    threads.append(_queue(gate, honest, 1, order, errors))
    wait_until(lambda: len(gate.waiting) == 4, 5, what="the honest request to queue")
    _release(release, holder, threads)
    assert order[0] == "honest" and order[1:] == ["greedy"] * 3 and not errors


def test_addresses_share_before_keys_do():
    """Eight keys at one address and one key at another, all backlogged with equal requests:
    the lone address gets every other turn, not one in nine."""
    gate = FairGate(slots=1, queue=64)
    sybils = [Flow(HOME, f"sybil-{i}") for i in range(8)]
    lone = Flow("10.0.0.2", "lone")
    release, holder = _held(gate, sybils[0], 100)
    order, errors, threads = [], [], []
    for _ in range(4):
        for flow in sybils:
            threads.append(_queue(gate, flow, 100, order, errors))
    for _ in range(4):
        threads.append(_queue(gate, lone, 100, order, errors))
    wait_until(lambda: len(gate.waiting) == 36, 5, what="every request to queue")
    _release(release, holder, threads)
    first = order[:8]
    assert first.count("lone") == 4, order  # every other turn until it has had its 4
    assert not errors


def test_a_full_queue_drops_the_largest_flow_s_newest_not_the_newcomer():
    gate = FairGate(slots=1, queue=3)
    greedy, honest = Flow(HOME, "greedy"), Flow(HOME, "honest")
    release, holder = _held(gate, greedy, 1)
    order, errors, threads = [], [], []
    for _ in range(3):
        threads.append(_queue(gate, greedy, 1, order, errors))
    wait_until(lambda: len(gate.waiting) == 3, 5, what="a full queue")
    threads.append(_queue(gate, honest, 1, order, errors))
    wait_until(lambda: errors, 5, what="a greedy waiter dropped")
    assert errors[0][0] == "greedy" and "dropped" in errors[0][1]
    _release(release, holder, threads)
    assert order[0] == "honest" and order.count("greedy") == 2
    # a flow with as many waiting as the newcomer would have is not dropped for it
    assert largest_flow([greedy, honest], honest) is None
    assert largest_flow([greedy, greedy, greedy], honest) == greedy


def test_a_big_request_leaves_a_place_for_small_ones():
    gate = FairGate(slots=2, queue=4, big_slots=1)
    big, small = Flow(HOME, "big"), Flow(HOME, "small")
    with gate.hold(big, 7800, 5, big=True):  # the one big place
        with pytest.raises(Busy, match="within"):  # a place is free, but not for a big one
            with gate.hold(big, 7800, 0.2, big=True):
                pass
        with gate.hold(small, 1, 0.2):  # ... for a small one at once
            pass


@pytest.mark.parametrize(
    "peer, want",
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv6:[2001:db8:1:2:3:4:5:6]:443", "2001:db8:1:2::/64"),
        ("ipv6:[::1]:443", "::1"),
        ("unix:/tmp/sock", "/tmp/sock"),
    ],
)
def test_flows_count_ipv6_by_its_64(peer, want):
    assert flow_of("k", peer) == Flow(want, "k")
    assert flow_of("", peer).key == peer  # no identity: the whole peer string is the key


def test_a_flows_next_request_waits_unread_while_one_of_its_own_waits():
    """`Guard.before_reading`: while a request of a flow waits for a compute place, that
    flow's next message is not read (another flow's is); it is read once the waiting one is
    let in, or refused "node busy" unread after the queue wait."""
    from moeshard.node.guard import Guard
    from moeshard.node.limits import Limits, Refused

    guard = Guard(Limits(max_active=1, max_queue=4, queue_wait_s=0.5).resolve(1 << 30, 1024, 4))
    greedy, other = Flow("198.51.100.7", "greedy"), Flow("203.0.113.9", "other")
    release, holding = threading.Event(), threading.Event()

    def hold(flow) -> None:
        with guard.work.hold(flow, 1, 10):  # (waits longer than before_reading's 0.5 s)
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold, args=(greedy,))
    holder.start()
    holding.wait(5)
    waiter = threading.Thread(target=hold, args=(greedy,))  # queued behind the holder
    waiter.start()
    wait_until(lambda: guard.work.waiting, 5, what="the greedy flow's second request to queue")
    guard.before_reading(other)  # another flow: read at once
    with pytest.raises(Refused, match="earlier request still waits"):
        guard.before_reading(greedy)  # its own waits: not read, then refused
    release.set()
    wait_until(lambda: not guard.work.waiting, 5, what="the waiter let in")
    guard.before_reading(greedy)  # nothing of its own waits any more
    holder.join()
    waiter.join()
