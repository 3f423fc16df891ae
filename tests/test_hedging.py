"""Hedged requests on a real loopback cluster (three node daemons, two copies of every
expert): a node that freezes mid-generation (SIGSTOP) has its share of the layer sent to a
replica once its reply is later than the swarm's recent p95, the layer does not wait out the
freeze, the tokens are the single machine's, the frozen node's late reply still counts
against its latency estimate, and a node still silent half a second later fails a ping and is
banned until it answers again. The fixtures are in conftest.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from helpers import PROMPT, TOKENS, NodeProcess, remote_runtime, wait_until

from moeshard.coordinator.generate import SamplingOptions, generate

FREEZE_S = 1.5


class Freeze:
    """Installed on a RemoteExperts: once `after` layer calls have been made, the node the
    next Forward goes to is stopped (SIGSTOP) and resumed `seconds` later."""

    def __init__(self, remote, cluster, after: int, seconds: float):
        self.remote, self.cluster, self.after, self.seconds = remote, cluster, after, seconds
        self.addrs = [n.addr for n in cluster]
        self.victim: int | None = None
        self.timer: threading.Timer | None = None
        self.send = remote._send
        remote._send = self

    def __call__(self, peer, request):
        if self.victim is None and self.remote.layer_calls >= self.after:
            self.victim = self.addrs.index(peer.addr)
            pid = self.cluster[self.victim].proc.pid
            os.kill(pid, signal.SIGSTOP)
            self.timer = threading.Timer(self.seconds, os.kill, (pid, signal.SIGCONT))
            self.timer.start()
        return self.send(peer, request)

    def join(self) -> None:
        if self.timer is not None:
            self.timer.join()


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_a_frozen_node_is_hedged_and_the_tokens_do_not_change(
    cluster_model, cluster, cluster_reference, transport
):
    transformer, remote = remote_runtime(
        cluster_model, [n.spec for n in cluster], transport=transport, audit=0.0
    )
    warm = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))  # latencies known
    assert warm.tokens == cluster_reference.tokens
    wins = remote.hedge_wins  # (a reply past p95 now and then is hedged too: that is the rule)
    freeze = Freeze(remote, cluster, remote.layer_calls + 10, FREEZE_S)
    calls_before = len(remote.layer_ms)
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert freeze.victim is not None and result.tokens == cluster_reference.tokens
        assert remote.hedge_wins > wins
        # no layer waited out the freeze: the hedge answered it
        assert max(remote.layer_ms[calls_before:]) < FREEZE_S * 1e3 / 2
        freeze.join()
        node = next(p for p in remote.peers.peers if p.addr == freeze.addrs[freeze.victim])
        # frozen past LATE_PING_S, it failed a ping and was banned; resumed, it is back
        wait_until(lambda: node.up, 15, what="the resumed node to be re-admitted")
        # its late reply counts in its latency estimate (a cancelled unary call: its time so
        # far, past the hedge point); and no reply of it is still counted as late
        late = FREEZE_S * 1e3 / 4 if transport == "stream" else remote.peers.hedge_after_ms(node)
        wait_until(lambda: max(node.latencies_ms) >= late, 10, what="the late reply to count")
        wait_until(lambda: not node.late, 10, what="its abandoned replies to be settled")
    finally:
        freeze.join()
        remote.close()


def test_a_node_that_dies_after_its_call_was_hedged_is_banned_at_once(
    cluster_model, cluster, cluster_plan, cluster_reference, caplog
):
    """Frozen, hedged, then killed: the abandoned call on its stream fails as the connection
    drops, which bans the node right then, not half a second later when its lateness would be
    pinged (a generation covered by hedges can end before any call of its own to the dead
    node fails: CI once saw the dead node still counted up after the generation). Streams
    only: an abandoned unary call is cancelled by us, so its end says nothing."""
    transformer, remote = remote_runtime(cluster_model, [n.spec for n in cluster], audit=0.0)
    generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))  # latencies known
    freeze = Freeze(remote, cluster, remote.layer_calls + 10, 60.0)
    killed = threading.Event()

    def kill_the_frozen_node() -> None:
        proc = cluster[freeze.victim].proc
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()
        killed.set()

    def freeze_then_kill(peer, request):
        was_frozen = freeze.victim is not None
        out = freeze(peer, request)
        if not was_frozen and freeze.victim is not None:
            threading.Timer(0.15, kill_the_frozen_node).start()
        return out

    remote._send = freeze_then_kill
    try:
        with caplog.at_level("WARNING", logger="moeshard.coordinator.remote.peers"):
            result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
            assert freeze.victim is not None and result.tokens == cluster_reference.tokens
            assert killed.wait(5)
            node = next(p for p in remote.peers.peers if p.addr == freeze.addrs[freeze.victim])

            def bans() -> list[str]:
                return [r.getMessage() for r in caplog.records if "banned" in r.getMessage()]

            # (the ban is logged just after the node is marked down, outside the peers' lock)
            wait_until(lambda: not node.up and bans(), 5, 0.02, what="the dead node banned")
        assert any("abandoned for a hedge failed: UNAVAILABLE" in m for m in bans()), bans()
    finally:
        killed.wait(5)
        if freeze.timer is not None:
            freeze.timer.cancel()
        remote.close()
        i = freeze.victim
        if i is not None and cluster[i].proc.poll() is not None:  # later tests: a full cluster
            restarted = NodeProcess(cluster_plan["nodes"][i]["dir"], port=cluster[i].port)
            cluster[i] = restarted.wait_ready()


def test_without_hedging_the_layer_waits_for_the_frozen_node(cluster_model, cluster):
    """The same freeze with hedging off: the layer that met it waits it out (the contrast
    that shows the test above measures the hedge, not a faster machine)."""
    transformer, remote = remote_runtime(
        cluster_model, [n.spec for n in cluster], hedge=False, audit=0.0
    )
    generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
    freeze = Freeze(remote, cluster, remote.layer_calls + 10, 0.6)
    try:
        before = len(remote.layer_ms)
        generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert freeze.victim is not None and remote.hedges == 0
        assert max(remote.layer_ms[before:]) > 300
    finally:
        freeze.join()
        remote.close()
