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
    domains: list[str] | None = None,
) -> list[list[tuple[int, int]]]:
    """Greedy: heaviest expert first onto the R nodes least loaded for their `capacity` (a
    relative weight per node, e.g. its RAM and disk speed: a node of twice the capacity takes
    twice the load, the hottest experts first; default: all equal). With `domains` (a
    failure-domain label per node: a house, a power circuit, an uplink), an expert's replicas
    go to as many different domains as there are, so losing every node of one domain leaves
    a copy of every expert when R >= 2 and there are two domains or more. Returns keys per
    node."""
    if nodes < 1 or not 1 <= replicas <= nodes:
        raise MoeshardError(f"need 1 <= --replicas ({replicas}) <= --nodes ({nodes})")
    weight = [1.0] * nodes if capacity is None else [float(c) for c in capacity]
    if len(weight) != nodes or not all(w > 0 for w in weight):
        raise MoeshardError(f"--capacity: {nodes} positive weights, one per node")
    if domains is not None and len(domains) != nodes:
        raise MoeshardError(f"--domains: {nodes} labels, one per node (got {len(domains)})")
    load = [0.0] * nodes
    nbytes = [0] * nodes
    placed: list[list[tuple[int, int]]] = [[] for _ in range(nodes)]
    for key in sorted(loads, key=lambda k: (-loads[k], k)):
        order = sorted(range(nodes), key=lambda n: (load[n] / weight[n], nbytes[n] / weight[n], n))
        best = order[:replicas] if domains is None else _spread(order, domains, replicas)
        for n in best:
            load[n] += loads[key]
            nbytes[n] += record_bytes
            placed[n].append(key)
    return [sorted(keys) for keys in placed]


def _spread(order: list[int], domains: list[str], replicas: int) -> list[int]:
    """The first `replicas` nodes of `order` taking a new domain each while there are new
    domains to take, then the next in order."""
    chosen: list[int] = []
    seen: set[str] = set()
    for n in order:
        if domains[n] not in seen:
            chosen.append(n)
            seen.add(domains[n])
        if len(chosen) == replicas:
            return chosen
    rest = [n for n in order if n not in chosen]
    return chosen + rest[: replicas - len(chosen)]


def survives_any_domain(placed: list[list[tuple[int, int]]], domains: list[str]) -> bool:
    """Whether every expert keeps a copy when all the nodes of any one domain are lost."""
    holders: dict[tuple[int, int], set[str]] = {}
    for n, keys in enumerate(placed):
        for key in keys:
            holders.setdefault(key, set()).add(domains[n])
    return all(len(d) >= 2 for d in holders.values())
