"""Which node holds which experts: the plan `moeshard shard` writes shard sets by, and the
swarm simulator places experts with (`moeshard.moe.analysis.swarm`)."""

from __future__ import annotations

from moeshard.moe.errors import MoeshardError


def plan_placement(
    loads: dict[tuple[int, int], float],
    record_bytes: int,
    nodes: int,
    replicas: int,
    capacity: list[float] | None = None,
) -> list[list[tuple[int, int]]]:
    """Greedy: heaviest expert first onto the R nodes least loaded for their `capacity` (a
    relative weight per node, e.g. its RAM: a node of twice the capacity takes twice the
    load, the hottest experts first; default: all equal). Returns keys per node."""
    if nodes < 1 or not 1 <= replicas <= nodes:
        raise MoeshardError(f"need 1 <= --replicas ({replicas}) <= --nodes ({nodes})")
    weight = [1.0] * nodes if capacity is None else [float(c) for c in capacity]
    if len(weight) != nodes or not all(w > 0 for w in weight):
        raise MoeshardError(f"--capacity: {nodes} positive weights, one per node")
    load = [0.0] * nodes
    nbytes = [0] * nodes
    placed: list[list[tuple[int, int]]] = [[] for _ in range(nodes)]
    for key in sorted(loads, key=lambda k: (-loads[k], k)):
        best = sorted(range(nodes), key=lambda n: (load[n] / weight[n], nbytes[n] / weight[n], n))[
            :replicas
        ]
        for n in best:
            load[n] += loads[key]
            nbytes[n] += record_bytes
            placed[n].append(key)
    return [sorted(keys) for keys in placed]
