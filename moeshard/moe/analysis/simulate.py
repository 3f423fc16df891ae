"""`moeshard simulate TRACE --geometry NAME|PRESET|MODEL --ram SIZE --disk PROFILE` (NAME: one
of `GEOMETRIES`, a published model's shape).

Replays a routing trace against the expert cache policies, next-layer prefetch and the file
layout, with a model of the disk (bandwidth by read size and queue depth) and of compute, and
predicts seconds and bytes per token for each configuration, at any model geometry.

Model of one decoded token, layer by layer:
  * the layer's trunk weights are resident or streamed (big sequential reads, overlapped with
    the previous layer's compute, as the streamed-trunk ring does);
  * the layer's k routed experts hit or miss the cache (policy: none / lru / lfu / pin);
    misses are known once the layer's router has run (after its trunk compute) and are read
    together at the configured queue depth, adjacent records (in file order or the packed
    order) merged into one read; the resident experts compute while they are read, then each
    missed expert computes when its read lands (reads complete one after another at the
    disk's bandwidth for that read size and queue depth);
  * with prefetch, the experts predicted for this layer were requested while the previous
    layer computed: a predicted miss costs only the part of its read time that the previous
    layer's compute and this layer's trunk compute did not hide. Prediction quality comes
    from the trace's own recall (measured by the real run) or `--prefetch-recall`;
  * compute = trunk bytes / memory bandwidth + active expert bytes / kernel throughput.

A trace from a small model says little about a large model's router: at another geometry the
trace's layers are reused cyclically and its expert ids scaled to the target expert count.
The projection is only as good as that assumption, and says so in its output.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from moeshard.moe.analysis.cachesim import ReplayCache
from moeshard.moe.analysis.disk import Disk
from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.policy import pin_count, pinned_keys
from moeshard.moe.storage.traces import DECODE, Trace


@dataclass
class Geometry:
    name: str
    layers: int  # MoE layers
    n_experts: int  # routed experts per layer
    top_k: int
    record_bytes: int  # one expert's packed bytes (gate + up + down)
    trunk_bytes: int  # whole trunk as stored
    params: float  # total parameters, for the report
    trunk_params: float | None = None  # the trunk's parameters, where known (`with_trunk`)
    row_width: int = 0  # the rows an expert takes and returns (K3: latent), for wire sizes


# bytes per weight of a trunk stored in each format (norms and routers, under 1% of a trunk,
# counted at the same rate)
TRUNK_BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def with_trunk(g: Geometry, fmt: str) -> Geometry:
    """The geometry with its trunk stored in `fmt` (`simulate --trunk`)."""
    if fmt not in TRUNK_BYTES_PER_WEIGHT:
        raise MoeshardError(f"--trunk {fmt}: choose one of {', '.join(TRUNK_BYTES_PER_WEIGHT)}")
    if not g.trunk_params:
        raise MoeshardError(f"--trunk: the trunk's parameter count of {g.name} is not known")
    trunk = int(g.trunk_params * TRUNK_BYTES_PER_WEIGHT[fmt])
    return replace(g, name=f"{g.name} (trunk {fmt})", trunk_bytes=trunk)


def q4_record(hidden: int, inter: int) -> int:
    return 3 * hidden * inter * 18 // 32  # q4_0: 18 bytes per 32 weights


def mxfp4_record(hidden: int, inter: int) -> int:
    return 3 * hidden * inter * 17 // 32  # mxfp4: 17 bytes per 32 weights


SEED_S_PER_TOKEN = 32.7  # the 2.78 T-parameter model in 8 GB this project set out to beat


def k3_geometry() -> Geometry:
    """Kimi K3 as released (the "Kimi-K3" flavor of torchtitan's kimi_k3 model at
    pytorch/torchtitan@9f8bcf0c): 93 layers (69 KDA, 24 gated MLA at 3, 7, ..., 91 and 92),
    hidden 7168, vocabulary 163840, layer 0 a dense FFN of 33792, the other 92 LatentMoE with
    896 experts of 3072 in a 3584-wide latent space, 16 active, two shared experts at full
    width.  Routed experts are MXFP4 as published (17.5 MB a record); the trunk, everything
    else, is counted in bf16 as published (small norms included): 56.7 G parameters, 113.5
    GB.  Total 2.78 T parameters."""
    dim, vocab, heads, layers, n_mla = 7168, 163840, 96, 93, 24
    latent, expert_inter, n_experts, shared = 3584, 3072, 896, 2
    kda_width, q_rank, kv_rank, nope, rope, v_dim, conv = 96 * 128, 1536, 512, 128, 64, 128, 4
    kda = (
        5 * dim * kda_width  # q, k, v, output gate, output projection
        + dim * 128
        + 128 * kda_width  # forget gate (low rank)
        + dim * heads
        + 3 * kda_width * conv
        + 2 * kda_width
        + 128  # beta, convs, A, dt, norm
    )
    mla = (
        dim * q_rank
        + q_rank
        + q_rank * heads * (nope + rope)  # q
        + dim * (kv_rank + rope)
        + kv_rank
        + kv_rank * heads * (nope + v_dim)  # kv
        + 2 * dim * heads * v_dim  # output gate, o_proj
    )
    moe = dim * n_experts + n_experts + 2 * dim * latent + latent + 3 * dim * shared * expert_inter
    trunk = (
        2 * vocab * dim  # embeddings, lm_head
        + (layers - n_mla) * kda + n_mla * mla
        + 3 * dim * 33792 + (layers - 1) * moe  # dense layer 0, LatentMoE's own weights
        + layers * (4 * dim + 2) + 2 * dim + 1  # norms, attention-residual projections
    )  # fmt: skip
    routed = (layers - 1) * n_experts * 3 * latent * expert_inter
    record = mxfp4_record(latent, expert_inter)
    return Geometry(
        "k3", layers - 1, n_experts, 16, record, 2 * trunk, float(trunk + routed), float(trunk),
        row_width=latent,
    )  # fmt: skip


def qwen3_next_geometry(name: str) -> Geometry:
    """Qwen3.6-35B-A3B or Qwen3-Next-80B-A3B at the published shape
    (`moeshard.moe.model.qwen3_next_shapes`), as `synth --preset` writes it: q4_0 experts
    (1.69 MiB records), a q8_0 trunk (every trunk tensor counted at q8_0's rate)."""
    from moeshard.moe.model.qwen3_next import Config
    from moeshard.moe.model.qwen3_next_shapes import QWEN_PRESETS, released_config

    c = Config.from_hf(released_config(QWEN_PRESETS[name]), name)
    trunk = sum(math.prod(shape) for shape in c.trunk_shapes().values())
    routed = len(c.moe_layers) * c.n_experts * 3 * c.hidden_size * c.expert_intermediate
    record = q4_record(c.hidden_size, c.expert_intermediate)
    trunk_bytes = int(trunk * TRUNK_BYTES_PER_WEIGHT["q8_0"])
    return Geometry(
        name, len(c.moe_layers), c.n_experts, c.top_k, record, trunk_bytes,
        float(trunk + routed), float(trunk), row_width=c.hidden_size,
    )  # fmt: skip


def k25_geometry() -> Geometry:
    """Kimi K2.5 / K2.6's language model as published (`synth --preset kimi-k2.5`: Kimi K2's
    shape, 61 layers, 60 of them MoE with 384 experts of 2048, 8 active): its INT4 experts as
    the q4_0 records `convert` keeps them as bit for bit (23.6 MiB), the trunk's 11.7 G
    parameters in bf16 as published (23.4 GB).  The vision tower, never run, is not counted."""
    from moeshard.moe.model.kimi_k25 import PUBLISHED, Config, released_config

    c = Config.from_hf(released_config(PUBLISHED), "kimi_k25.PUBLISHED")
    trunk = sum(math.prod(shape) for shape in c.trunk_shapes().values())
    routed = len(c.moe_layers) * c.n_experts * 3 * c.hidden_size * c.expert_intermediate
    record = q4_record(c.hidden_size, c.expert_intermediate)
    return Geometry(
        "k2.5", len(c.moe_layers), c.n_experts, c.top_k, record, 2 * trunk,
        float(trunk + routed), float(trunk), row_width=c.hidden_size,
    )  # fmt: skip


def gpt_oss_geometry(name: str) -> Geometry:
    """gpt-oss-20b or -120b as published: MXFP4 expert records with their biases (`mxfp4+bias`,
    13.3 MB), the rest in bf16 as published (its parameters from the family's trunk tensors)."""
    from moeshard.moe.kernels import quant
    from moeshard.moe.model.gpt_oss import Config, published_config

    c = Config.from_hf(published_config(name), name)
    trunk = sum(math.prod(shape) for shape in c.trunk_shapes().values())
    record = quant.expert_record_nbytes("mxfp4" + quant.BIAS, c.hidden_size, c.expert_intermediate)
    routed = len(c.moe_layers) * c.n_experts * (3 * c.hidden_size + 2) * c.expert_intermediate
    return Geometry(
        name, len(c.moe_layers), c.n_experts, c.top_k, record, 2 * trunk, float(trunk + routed),
        float(trunk), row_width=c.hidden_size,
    )  # fmt: skip


GEOMETRIES = {
    # Kimi K3: 2.78 T parameters, 92 MoE layers of 896 experts, 16 active, MXFP4 experts.
    "k3": k3_geometry(),
    # Kimi-K2 (DeepSeek-V3 architecture): 1.04 T, 384 experts, 8 active, 60 MoE layers.
    "k2": Geometry("k2", 60, 384, 8, q4_record(7168, 2048), int(16.0e9), 1.04e12, row_width=7168),
    # Qwen3.6-35B-A3B: 40 MoE layers of 256 experts, 8 active; Qwen3-Next-80B-A3B: 48 of 512,
    # 10 active (q4_0 experts, q8_0 trunk)
    "qwen3.6-35b-a3b": qwen3_next_geometry("qwen3.6-35b-a3b"),
    "qwen3-next-80b-a3b": qwen3_next_geometry("qwen3-next-80b-a3b"),
    # gpt-oss-20b: 24 MoE layers of 32 experts, 4 active; -120b: 36 of 128 (MXFP4 experts
    # with biases, bf16 trunk)
    "gpt-oss-20b": gpt_oss_geometry("gpt-oss-20b"),
    "gpt-oss-120b": gpt_oss_geometry("gpt-oss-120b"),
    # Kimi K2.5 / K2.6: K2's language model, INT4 experts kept as q4_0, the trunk in bf16.
    "k2.5": k25_geometry(),
}


@dataclass
class Config:
    policy: str  # none | lru | lfu | pin
    prefetch: bool
    packed: bool


@dataclass
class Result:
    config: Config
    s_per_token: float
    gb_per_token: float
    hit_rate: float
    stall_share: float
    extra: dict = field(default_factory=dict)


def project(trace: Trace, geometry: Geometry) -> list[np.ndarray]:
    """Per decoded token, per target layer: expert ids [k] (see module docstring)."""
    scale = geometry.n_experts / trace.n_experts
    tokens = []
    for seq in _decoded_rows(trace, geometry, trace.ids):
        out = []
        for i, src in enumerate(seq):
            ids = np.unique((src * scale).astype(np.int64))[: geometry.top_k]
            if len(ids) < geometry.top_k:  # a small trace has fewer than k experts per layer
                extra = (src[:, None] * scale + np.arange(1, geometry.top_k)).astype(np.int64)
                ids = np.unique(np.concatenate([ids, extra.reshape(-1) % geometry.n_experts]))
                ids = ids[: geometry.top_k]
            out.append(ids + i * geometry.n_experts)
        tokens.append(np.stack(out))
    if not tokens:
        raise MoeshardError("the trace has no decoded tokens to replay")
    return tokens


def project_hints(trace: Trace, geometry: Geometry) -> list[list[np.ndarray]] | None:
    """Per decoded token (as `project`'s), per target layer: the keys the runtime's prefetch
    hint predicted for that layer (empty where none was sent: the first MoE layer). None for
    a trace recorded without hints, or at another geometry than the trace's own (the hints of
    a small model's router say nothing about a scaled one's)."""
    same = geometry.n_experts == trace.n_experts and geometry.layers == len(trace.moe_layers)
    if trace.hinted is None or not same:
        return None
    return [
        [
            np.unique(src[src >= 0]).astype(np.int64) + i * geometry.n_experts
            for i, src in enumerate(seq)
        ]  # fmt: skip
        for seq in _decoded_rows(trace, geometry, trace.hinted)
    ]


def _decoded_rows(trace: Trace, geometry: Geometry, column: np.ndarray):
    """Per decoded token with a row at every target layer: that column's row per layer."""
    decode = trace.phase == DECODE
    rows = column[decode].astype(np.int64)
    layers = trace.layer[decode]
    positions = trace.position[decode].astype(np.int64) + (trace.run[decode].astype(np.int64) << 32)
    src_layers = trace.moe_layers
    for pos in np.unique(positions):
        mine = positions == pos
        by_layer = {int(layer): row for layer, row in zip(layers[mine], rows[mine], strict=True)}
        seq = []
        for i in range(geometry.layers):
            src = by_layer.get(src_layers[i % len(src_layers)])
            if src is None:
                break
            seq.append(src)
        if len(seq) == geometry.layers:
            yield seq


def prefill_sets(trace: Trace, geometry: Geometry) -> list[np.ndarray]:
    """Per target layer: every expert the prompt's rows used there (ids like `project`'s).

    A real run computes the whole prompt in one pass per layer, so its cache enters decoding
    warm with these sets; `simulate(warm=...)` replays them, uncounted, before the decode."""
    prefill = trace.phase != DECODE
    rows = trace.ids[prefill].astype(np.int64)
    layers = trace.layer[prefill]
    src_layers = trace.moe_layers
    scale = geometry.n_experts / trace.n_experts
    sets = []
    for i in range(geometry.layers):
        src = rows[layers == src_layers[i % len(src_layers)]]
        ids = np.unique((src.reshape(-1) * scale).astype(np.int64))
        sets.append(ids + i * geometry.n_experts)
    return sets


def packed_slots(tokens: list[np.ndarray], g: Geometry) -> np.ndarray:
    """File slot of every record after `moeshard pack` (co-activation seriation per layer)."""
    from moeshard.moe.analysis.coact import seriate

    slot = np.arange(g.layers * g.n_experts, dtype=np.int64)
    stacked = np.stack(tokens)  # [tokens, layers, k]
    for i in range(g.layers):
        ids = stacked[:, i, :] - i * g.n_experts  # [tokens, k]
        onehot = np.zeros((len(ids), g.n_experts), dtype=np.int64)
        np.put_along_axis(onehot, ids, 1, axis=1)
        co = onehot.T @ onehot  # [E, E]
        np.fill_diagonal(co, 0)
        order = np.asarray(seriate(co, onehot.sum(axis=0)))
        slot[i * g.n_experts + order] = i * g.n_experts + np.arange(g.n_experts)
    return slot


def simulate(
    tokens: list[np.ndarray],
    geometry: Geometry,
    ram_bytes: int,
    disk: Disk,
    config: Config,
    depth: int = 8,
    kernel_gbps: float = 7.0,
    memory_gbps: float = 20.0,
    prefetch_recall: float = 0.8,
    trunk_resident_share: float | None = None,
    seed: int = 0,
    capacity: int | None = None,
    trunk_s: float | None = None,
    expert_s: float | None = None,
    warm: list[np.ndarray] | None = None,
) -> Result:
    """Predicted steady-state decode cost per token (see the module docstring).

    `capacity` (cache records), `trunk_s` (one layer's non-expert compute) and `expert_s` (one
    expert's kernel time) override the values derived from the budget and the kernel/memory
    throughputs, e.g. to replay a real run's own plan; `warm` (per layer, the experts of a
    prompt: `prefill_sets`) fills the cache first, uncounted."""
    _check_rates(depth, kernel_gbps, memory_gbps, prefetch_recall)
    rng = np.random.default_rng(seed)
    g = geometry
    trunk_per_layer = g.trunk_bytes / g.layers
    if trunk_resident_share is None:  # the trunk gets RAM first, up to half the budget
        trunk_resident_share = min(1.0, 0.5 * ram_bytes / g.trunk_bytes) if g.trunk_bytes else 1.0
    ring = 0 if trunk_resident_share >= 1 else 2 * trunk_per_layer
    if capacity is None:
        cache_bytes = ram_bytes - trunk_resident_share * g.trunk_bytes - ring
        capacity = max(0, int(cache_bytes // g.record_bytes))
    pinned: set[int] = set()
    if config.policy == "pin":  # the store's rule, from the trace's own usage counts
        usage = Counter(np.concatenate([t.reshape(-1) for t in tokens]).tolist())
        pf = g.top_k if config.prefetch else 0
        pinned = pinned_keys(usage, pin_count(capacity + pf, g.top_k, pf))
    cache = ReplayCache(capacity, config.policy, pinned)
    slot = packed_slots(tokens, g) if config.packed else np.arange(g.layers * g.n_experts)
    if trunk_s is None:  # trunk weights from RAM
        trunk_s = trunk_per_layer / (memory_gbps * 1e9)
    if expert_s is None:  # one active expert through the kernels
        expert_s = g.record_bytes / (kernel_gbps * 1e9)
    streamed_trunk = (1 - trunk_resident_share) * trunk_per_layer
    trunk_read_s = streamed_trunk / (disk.gbps(8 << 20, 4) * 1e9)
    for layer_ids in warm or []:
        keys = layer_ids.tolist()
        cache.begin_call()
        for k in keys:
            cache.insert(k, set(keys))
            cache.touch(k)
    total_s = stall_s = 0.0
    bytes_read = hits = accesses = 0
    now = disk_free = 0.0  # the clock, and when the disk has finished every queued read
    trunk_ready = 0.0  # when the current layer's streamed trunk slice has landed
    ready: dict[int, float] = {}  # prefetched record -> when its read lands
    for token in tokens:
        for i, layer_ids in enumerate(token):
            keys = layer_ids.tolist()
            cache.begin_call()
            accesses += len(keys)
            demand = [k for k in keys if k not in cache]
            hits += len(keys) - len(demand)  # prefetched records count as hits, as in the store
            compute = trunk_s + len(keys) * expert_s
            # the ring: this layer's streamed trunk slice was queued when the previous layer
            # started; the next layer's slice is queued now, ahead of this layer's misses
            trunk_stall = max(0.0, trunk_ready - now)
            if trunk_read_s:
                trunk_ready = disk_free = max(disk_free, now + trunk_stall) + trunk_read_s
            routed = now + trunk_stall + trunk_s  # misses are known once the router has run
            landed = _landing_times(demand, slot, g, disk, depth, max(disk_free, routed))
            disk_free = max([disk_free, *landed])
            bytes_read += len(demand) * g.record_bytes + int(streamed_trunk)
            for k in demand:
                cache.insert(k, set(keys))
            if config.prefetch and i + 1 < len(token):  # queued behind this layer's misses
                guess = _predict(token[i + 1], g, prefetch_recall, rng)
                fetch = [k for k in guess if k not in cache]
                times = _landing_times(fetch, slot, g, disk, depth, max(disk_free, routed))
                disk_free = max([disk_free, *times])
                bytes_read += len(fetch) * g.record_bytes
                protect = set(keys) | set(guess)
                for k, at in zip(fetch, times, strict=True):
                    cache.insert(k, protect)
                    ready[k] = at
            # the store's order: resident experts first (a prefetched one once it has landed),
            # then each missed expert as its read lands
            t = routed
            for at in sorted(ready.pop(k, 0.0) for k in keys if k not in demand):
                t = max(t, at) + expert_s
            for at in sorted(landed):
                t = max(t, at) + expert_s
            stall_s += (t - now) - compute
            total_s += t - now
            now = t
            for k in keys:
                cache.touch(k)
    n = len(tokens)
    return Result(
        config,
        total_s / n,
        bytes_read / n / 1e9,
        hits / max(accesses, 1),
        stall_s / max(total_s, 1e-12),
        {"cache_records": capacity, "trunk_resident_share": trunk_resident_share},
    )


def _check_rates(depth: int, kernel_gbps: float, memory_gbps: float, recall: float) -> None:
    """The simulator's numbers in range (a 0 GB/s throughput would divide by zero; a negative,
    nan or infinite one, or a recall outside [0, 1], would be simulated as if it meant
    something). The CLI checks them first, naming its options."""
    if depth < 1:
        raise MoeshardError(f"queue depth {depth}: need at least 1")
    for name, value in (("kernel", kernel_gbps), ("memory", memory_gbps)):
        if not (math.isfinite(value) and value > 0):
            raise MoeshardError(f"{name} throughput {value} GB/s: need a positive, finite number")
    if not (math.isfinite(recall) and 0 <= recall <= 1):
        raise MoeshardError(f"prefetch recall {recall}: need a share between 0 and 1")


def _predict(true_ids: np.ndarray, g: Geometry, recall: float, rng) -> list[int]:
    """The next layer's prediction: as many experts as it uses, each right with probability
    `recall` (precision = recall, as for a top-k guess), the wrong ones drawn from the rest of
    that layer's experts."""
    true = true_ids.tolist()
    right = [k for k in true if rng.random() < recall]
    base = (true[0] // g.n_experts) * g.n_experts
    others = np.setdiff1d(np.arange(base, base + g.n_experts), true_ids)
    wrong = rng.choice(others, size=min(len(true) - len(right), len(others)), replace=False)
    return right + wrong.tolist()


def _landing_times(
    keys: list[int], slot: np.ndarray, g: Geometry, disk: Disk, depth: int, start: float
) -> list[float]:
    """When each record's read completes (in `keys` order): the runs (adjacent records merged)
    start together at `start` in file order and complete one
    after another at the bandwidth the disk model gives the whole batch (the device serves
    `depth` requests at once, so completions arrive spread out rather than `depth` at a
    time). One time per record."""
    if not keys:
        return []
    slots = np.sort(slot[np.asarray(keys)])
    runs = np.split(slots, np.nonzero(np.diff(slots) > 1)[0] + 1)
    sizes = [len(r) * g.record_bytes for r in runs]
    per_byte = disk.read_seconds(sizes, depth) / sum(sizes)
    at, t = {}, start
    for run, size in zip(runs, sizes, strict=True):
        t += size * per_byte
        at.update((int(s), t) for s in run)
    return [at[int(slot[k])] for k in keys]


CONFIGS = [
    Config("none", False, False),
    Config("lru", False, False),
    Config("lfu", False, False),
    Config("pin", False, False),
    Config("lru", True, False),
    Config("lfu", True, False),
    Config("lfu", True, True),
]


def geometry_of(spec: str) -> Geometry:
    """A named geometry (`GEOMETRIES`) or the geometry of a model directory."""
    if spec in GEOMETRIES:
        return GEOMETRIES[spec]
    from moeshard.moe.kernels import quant
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.storage.io import align_up
    from moeshard.moe.storage.manifest import TRUNK_FILE

    model = ModelDir(spec)
    c = model.config
    record = align_up(
        quant.expert_record_nbytes(model.expert_format, c.expert_hidden, c.expert_intermediate)
    )
    trunk = model.path / TRUNK_FILE
    params = model.manifest.get("params", {})
    model.close()
    return Geometry(
        str(spec),
        len(c.moe_layers),
        c.n_experts,
        c.top_k,
        record,
        trunk.stat().st_size if trunk.exists() else 0,
        float(params.get("trunk", 0) + params.get("experts", 0)),
        float(params.get("trunk", 0)) or None,
        row_width=c.expert_hidden,
    )


def config_geometry(name: str, raw: dict, experts_fmt: str, trunk_bytes: int) -> Geometry:
    """The geometry of a model known by its config.json, its experts' format and its trunk's
    stored bytes (a synth preset's, `synth.preset_sizes`, before any disk holds it)."""
    from moeshard.moe.kernels import quant
    from moeshard.moe.model.families import family_for
    from moeshard.moe.storage.io import align_up

    c = family_for(raw["model_type"], name).Config.from_hf(raw, name)
    trunk = sum(math.prod(shape) for shape in c.trunk_shapes().values())
    experts = len(c.moe_layers) * c.n_experts * 3 * c.expert_hidden * c.expert_intermediate
    record = align_up(
        quant.expert_record_nbytes(experts_fmt, c.expert_hidden, c.expert_intermediate)
    )
    return Geometry(
        name, len(c.moe_layers), c.n_experts, c.top_k, record, trunk_bytes,
        float(trunk + experts), float(trunk), row_width=c.expert_hidden,
    )  # fmt: skip


def run_all(trace: Trace, geometry: Geometry, ram_bytes: int, disk: Disk, **kw) -> list[Result]:
    tokens = project(trace, geometry)
    return [simulate(tokens, geometry, ram_bytes, disk, c, **kw) for c in CONFIGS]


def table(results: list[Result], geometry: Geometry, ram_bytes: int, disk_name: str) -> str:
    lines = [
        f"geometry {geometry.name}: {geometry.params / 1e9:,.0f} B params, {geometry.layers} MoE "
        f"layers x {geometry.n_experts} experts, top-{geometry.top_k}, expert record "
        f"{geometry.record_bytes / 2**20:.1f} MiB, trunk {geometry.trunk_bytes / 2**30:.1f} GiB; "
        f"RAM {ram_bytes / 2**30:.1f} GiB; disk {disk_name}; cache "
        f"{results[0].extra['cache_records']} records, trunk "
        f"{results[0].extra['trunk_resident_share']:.0%} resident",
        f"{'policy':>7} {'prefetch':>8} {'layout':>7} {'s/token':>9} {'GB/token':>9} "
        f"{'hit rate':>9} {'stall':>6}",
    ]
    for r in results:
        c = r.config
        lines.append(
            f"{c.policy:>7} {'on' if c.prefetch else 'off':>8} "
            f"{'packed' if c.packed else 'file':>7} {r.s_per_token:>9.3f} {r.gb_per_token:>9.3f} "
            f"{r.hit_rate:>9.1%} {r.stall_share:>6.1%}"
        )
    if geometry.name.startswith("k3"):  # the same model as the original setup
        best = min(r.s_per_token for r in results)
        lines.append(
            f"beside the original setup (this 2.78 T model in 8 GB of RAM, NVMe): "
            f"{SEED_S_PER_TOKEN} s/token; best row here {best:.1f} s/token, "
            f"{SEED_S_PER_TOKEN / best:.2f}x its speed (the trunk's streaming included)"
        )
    return "\n".join(lines)
