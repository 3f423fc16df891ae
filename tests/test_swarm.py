"""The swarm simulator (`moeshard simulate --swarm`): its file is checked field by field, and
its predictions move the way the model in moeshard/moe/analysis/swarm.py says they must."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from helpers import ROOT

from moeshard.moe.analysis.simulate import Geometry
from moeshard.moe.analysis.swarm import load_swarm, simulate_swarm
from moeshard.moe.errors import MoeshardError

G = Geometry("test", layers=8, n_experts=64, top_k=4, record_bytes=4 << 20,
             trunk_bytes=800 << 20, params=0.0, row_width=1024)  # fmt: skip

SWARM = """
replicas = 2
[coordinator]
ram = "8G"
[[nodes]]
count = {count}
ram = "{ram}"
rtt_ms = {rtt}
link_gbit = 1
"""


def tokens(n: int = 40, seed: int = 0) -> list[np.ndarray]:
    """n decoded tokens of G, skewed routing: [layers, k] keys each."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, G.n_experts + 1)
    p /= p.sum()
    out = []
    for _ in range(n):
        rows = [rng.choice(G.n_experts, G.top_k, replace=False, p=p) + i * G.n_experts
                for i in range(G.layers)]  # fmt: skip
        out.append(np.stack(rows))
    return out


def swarm(tmp_path, count=8, ram="64M", rtt="[0.3, 0.3]", extra=""):
    path = tmp_path / f"s{count}-{ram}-{len(extra)}.toml"
    path.write_text(extra + SWARM.format(count=count, ram=ram, rtt=rtt))
    return load_swarm(path)


def test_more_nodes_hold_more_in_their_caches_and_answer_sooner(tmp_path):
    small = simulate_swarm(tokens(), G, swarm(tmp_path, 4))
    large = simulate_swarm(tokens(), G, swarm(tmp_path, 16))
    assert large.hit_rate > small.hit_rate
    assert large.s_per_token < small.s_per_token


def test_replayed_hints_are_what_the_nodes_prefetch(tmp_path):
    """Hints replayed from a trace decide what is read ahead: hints naming exactly the next
    layer's experts make nearly every layer after the first a hit (in flight counts as a hit;
    a node's two-record cache may still drop one, or the call pick the other replica); empty
    hints prefetch nothing; a guess at recall 0.8 lies between."""
    toks = tokens()
    s = swarm(tmp_path, 8, ram="8M")  # two records per node: prefetch is all that helps
    exact = [[row for row in t] for t in toks]
    none = [[np.array([], np.int64) for _ in t] for t in toks]
    perfect = simulate_swarm(toks, G, s, hints=exact)
    nothing = simulate_swarm(toks, G, s, hints=none)
    guessed = simulate_swarm(toks, G, s)
    assert perfect.hit_rate > 0.8
    assert nothing.hit_rate < guessed.hit_rate < perfect.hit_rate
    with pytest.raises(MoeshardError, match="tokens of hints"):
        simulate_swarm(toks, G, s, hints=exact[:-1])


def test_each_layer_waits_one_round_trip(tmp_path):
    """10 ms more RTT on every node costs 10 ms per MoE layer per token (nothing else moves)."""
    near = simulate_swarm(tokens(), G, swarm(tmp_path, 8, rtt="[0.3, 0.3]"))
    far = simulate_swarm(tokens(), G, swarm(tmp_path, 8, rtt="[10.3, 10.3]"))
    assert far.s_per_token - near.s_per_token == pytest.approx(G.layers * 0.010, rel=0.05)


def test_a_trunk_too_big_for_the_coordinator_is_streamed_and_costs_more(tmp_path):
    fits = simulate_swarm(tokens(), G, swarm(tmp_path, 8))
    s = swarm(tmp_path, 8)
    small = replace(s, coordinator=replace(s.coordinator, ram=256 << 20))
    assert simulate_swarm(tokens(), G, small).parts["trunk"] > fits.parts["trunk"]


def test_many_coordinators_are_capped_by_the_busiest_node(tmp_path):
    one = simulate_swarm(tokens(), G, swarm(tmp_path, 4, ram="8M"))
    s = swarm(tmp_path, 4, ram="8M")
    many = simulate_swarm(tokens(), G, replace(s, coordinators=64))
    assert many.tokens_per_s > one.tokens_per_s
    assert many.bound.startswith("node ")  # saturated: more users, not more tokens
    assert many.s_per_token > one.s_per_token


def test_choosing_replicas_by_finish_time_beats_the_first_holder(tmp_path):
    """The runtime's rule (the holder that would finish its share of the layer first) beats
    always asking the first holder; plain spreading loses the caches' locality (an expert
    asked of either holder is cached twice), so its hit rate is the lowest of the three."""
    s = swarm(tmp_path, 8, ram="8M")
    rank = simulate_swarm(tokens(), G, replace(s, replica_choice="rank"))
    finish = simulate_swarm(tokens(), G, s)  # the default
    spread = simulate_swarm(tokens(), G, replace(s, replica_choice="least-busy"))
    assert finish.s_per_token < rank.s_per_token
    assert spread.hit_rate < min(rank.hit_rate, finish.hit_rate)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("replicas = 2\n[[nodes]]\ncount = 2\nram = '1G'\n", "needs a [coordinator] table"),
        ("[coordinator]\nram = '1G'\n", "at least one [[nodes]]"),
        ("[coordinator]\nram = '1G'\n[[nodes]]\ncount = 0\nram = '1G'\n", "count"),
        ("[coordinator]\nram = '1G'\n[[nodes]]\ncount = 2\nram = '1G'\nrtt_ms = 'lan'\n", "rtt_ms"),
        ("hedge = 'no'\n[coordinator]\nram = '1G'\n[[nodes]]\ncount = 2\nram = '1G'\n", "hedge"),
        ("replicas = 3\n[coordinator]\nram = '1G'\n[[nodes]]\ncount = 2\nram = '1G'\n", "replicas"),
        ("[coordinator\n", "not a readable swarm file"),
    ],
)
def test_a_bad_swarm_file_is_one_clear_error(tmp_path, text, says):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(MoeshardError, match=r"bad\.toml.*" + says.replace("[", r"\[")):
        load_swarm(path)


def test_the_command_prints_one_line_per_node_count(tmp_path, converted):
    model = converted("qwen3_moe")
    trace = tmp_path / "t.npz"
    run = [sys.executable, "-m", "moeshard"]
    made = subprocess.run(
        [*run, "generate", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "12",
         "--trace", str(trace)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    file = tmp_path / "s.toml"
    file.write_text(SWARM.format(count=4, ram="1G", rtt="[0.2, 0.5]"))
    out = subprocess.run(
        [*run, "simulate", str(trace), "--geometry", "k3", "--swarm", str(file),
         "--nodes", "4,8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["4", "8"] and all(float(r[1]) > 0 for r in rows)


def test_placing_by_ram_caches_more_of_a_swarm_of_unequal_nodes(tmp_path):
    """Half the nodes with 8x the RAM, every node's disk slow: weighting the placement by RAM
    (`shard --capacity`) puts more of the load, the hottest experts first, where it can be
    cached, and the swarm's cache hit rate rises. (In this model the token does not get
    faster: each layer still waits for its slowest node, often a small one that missed, and
    the big nodes now compute more; what placement by capacity buys is fewer reads.) Without
    prefetch hints: a hinted read in flight counts as a hit, as the store counts it, and hides
    the difference."""
    path = tmp_path / "mixed.toml"
    big = SWARM.format(count=4, ram="96M", rtt="[0.3, 0.3]") + "disk = 'this-machine'\n"
    small = "\n[[nodes]]\ncount = 4\nram = '12M'\nrtt_ms = 0.3\ndisk = 'this-machine'\n"
    path.write_text(big + small)
    s = replace(load_swarm(path), prefetch_recall=0.0)
    equal = simulate_swarm(tokens(), G, s)
    by_ram = simulate_swarm(tokens(), G, replace(s, placement="ram"))
    assert by_ram.hit_rate > equal.hit_rate + 0.05


def test_capacity_weights_place_proportionally():
    from moeshard.moe.analysis.placement import plan_placement

    loads = {(0, e): 1.0 for e in range(300)}
    placed = plan_placement(loads, 1, 3, 1, capacity=[2, 1, 1])
    assert [len(p) for p in placed] == [150, 75, 75]
    assert plan_placement(loads, 1, 3, 1) == plan_placement(loads, 1, 3, 1, [1, 1, 1])
    with pytest.raises(MoeshardError, match="positive weights"):
        plan_placement(loads, 1, 3, 1, capacity=[1, 0, 1])


def test_shard_takes_a_capacity_per_node(tmp_path, converted):
    """`moeshard shard --capacity 2,1,1`: the first node gets about twice the experts of each
    other; a weight list of the wrong length, or a weight that is not positive, is refused."""
    model = converted("qwen3_moe")
    run = [sys.executable, "-m", "moeshard", "shard", str(model), "--nodes", "3"]
    run += ["--replicas", "1"]
    done = subprocess.run(
        [*run, "--capacity", "2,1,1", "--out", str(tmp_path / "s")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    counts = [int(line.split(": ")[1].split()[0]) for line in done.stdout.splitlines()[:3]]
    assert counts[0] == pytest.approx(2 * counts[1], abs=2) and counts[1] == pytest.approx(
        counts[2], abs=1
    ), counts
    for bad in ("2,1", "2,0,1", "2,x,1", "nan,1,1"):
        refused = subprocess.run(
            [*run, "--capacity", bad, "--out", str(tmp_path / "t")],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert refused.returncode == 2 and "--capacity" in refused.stderr, (bad, refused.stderr)
        assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nodes", "4"], "--nodes: only with --swarm FILE"),
        (["--coordinator-ram", "8G"], "--coordinator-ram: only with --swarm FILE"),
        (["--swarm", "SWARM", "--trunk-hosts", "0"], "--trunk-hosts 0: need at least 1"),
        (["--swarm", "SWARM", "--nodes", "1"], "at least --replicas (2) nodes"),
        (["--swarm", "SWARM", "--nodes", "4,x"], "node counts"),
    ],
)
def test_simulate_refuses_swarm_options_it_cannot_use(tmp_path, args, says):
    trace = tmp_path / "t.npz"
    trace.write_bytes(b"")  # (refused before the trace is read)
    file = tmp_path / "s.toml"
    file.write_text(SWARM.format(count=4, ram="1G", rtt="0.3"))
    argv = [a.replace("SWARM", str(file)) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "moeshard", "simulate", str(trace), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1  # one line


def test_replicas_spread_over_failure_domains():
    """Three houses of two nodes each: every expert's two copies are in two houses, so losing
    a whole house keeps a copy of everything; without domains the plan does not promise it."""
    from moeshard.moe.analysis.placement import plan_placement, survives_any_domain

    loads = {(0, e): 1.0 + (e % 7) for e in range(120)}
    domains = ["a", "a", "b", "b", "c", "c"]
    placed = plan_placement(loads, 1, 6, 2, domains=domains)
    assert survives_any_domain(placed, domains)
    for gone in "abc":
        alive = {k for n, keys in enumerate(placed) if domains[n] != gone for k in keys}
        assert alive == set(loads)
    plain = plan_placement(loads, 1, 6, 2)
    assert not survives_any_domain(plain, domains)  # nodes 0 and 1 share experts
    assert max(map(len, placed)) - min(map(len, placed)) <= 2  # still balanced
    with pytest.raises(MoeshardError, match="one per node"):
        plan_placement(loads, 1, 6, 2, domains=["a", "b"])


def test_hedged_requests_cut_the_tail_a_stalling_node_makes(tmp_path):
    """One node of eight freezes 150 ms every second: with hedging (the runtime's rule) its
    late shares go to the other holders, and the p99 step falls; without, the steps that meet
    a freeze wait it out."""
    path = tmp_path / "stall.toml"
    fast = SWARM.format(count=7, ram="64M", rtt="[0.3, 0.3]")
    slow = (
        "\n[[nodes]]\ncount = 1\nram = '64M'\nrtt_ms = 0.3\nstall_ms = 150\nstall_every_s = 1.0\n"
    )
    path.write_text(fast + slow)
    s = load_swarm(path)
    hedged = simulate_swarm(tokens(200), G, s)
    plain = simulate_swarm(tokens(200), G, replace(s, hedge=False))
    assert hedged.hedges_per_token > 0 and plain.hedges_per_token == 0
    assert hedged.p99_step_s < plain.p99_step_s / 1.5
    assert hedged.s_per_token < plain.s_per_token
