"""The audit cache (`coordinator/remote/records.py`) and the recomputation it feeds
(`moeshard.moe.experts.compute.recompute_partial_sum`): any grouping of a call's experts into waves
gives the bits every backend gives; the cache evicts least recently used records, frees a slot
whose load failed, and two auditor threads using it at once each get their own records."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moeshard.coordinator.remote.records import RecordCache, default_budget
from moeshard.moe.experts.compute import recompute_partial_sum
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.shards import ShardSet


@pytest.fixture(scope="module")
def model(converted):
    return ModelDir(converted("qwen3_moe", experts="q4_0"))


def _no_records(model) -> ShardSet:
    """The model's geometry with no records of its own: every record must be obtained."""
    s = model.shard_set
    return ShardSet([], model.model_id, s.fmt, s.hidden, s.inter, s.glu)


def _call(model, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    k, experts = model.config.top_k, len(model.shard_set.keys_of_layer(model.config.moe_layers[0]))
    hidden = rng.standard_normal((rows, model.shard_set.hidden), dtype=np.float32)  # [T, H]
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)])  # [T, k]
    if rows > 1:
        ids[0, :] = -1  # a row that names no expert: left 0
    weights = rng.random((rows, k), dtype=np.float32)  # [T, k]
    return hidden, ids.astype(np.int32), weights


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("most", [1, 2, 0])
def test_recomputing_in_waves_gives_every_backends_bits(model, rows, most):
    """One wave or one record at a time, from fetched records: the bits of the node's own
    backends (the in-RAM experts' fused kernels, the streaming cache's waves)."""
    layer = model.config.moe_layers[0]
    hidden, ids, weights = _call(model, rows, seed=rows)
    live = (ids >= 0).any(axis=1)
    local = np.zeros(hidden.shape)  # [T, H]
    local[live] = LocalExperts(model.shard_set)(
        layer, hidden[live], ids[live], weights[live], dtype=np.float64
    )
    store = ExpertStore(model.shard_set, 4, model.config.top_k, prefetch=False)
    streamed = np.zeros(hidden.shape)  # [T, H]
    streamed[live] = store(layer, hidden[live], ids[live], weights[live], dtype=np.float64)
    store.close()
    shards = model.shard_set
    cache = RecordCache(_no_records(model), 0)
    fetched = []

    def obtain(key, out):
        out[:] = shards.read(*key)
        fetched.append(key)
        return out.size

    waves = lambda experts: cache.waves(layer, experts, obtain, most)  # noqa: E731
    again = recompute_partial_sum(
        waves, shards.fmt, shards.hidden, shards.inter, shards.glu, hidden, ids, weights
    )  # [T, H]
    assert np.array_equal(again.view(np.uint64), local.view(np.uint64))
    assert np.array_equal(again.view(np.uint64), streamed.view(np.uint64))
    assert (rows == 1 or not again[0].any()) and len(set(fetched)) == len(fetched)  # each once
    assert cache.stats.fetched == len(fetched) and not cache.pinned


def test_the_cache_evicts_the_least_recently_used_and_frees_a_failed_slot(model):
    shards = model.shard_set
    cache = RecordCache(_no_records(model), 4 * 4096)  # four slots at least
    layer = model.config.moe_layers[0]

    def obtain(key, out):
        if key[1] == 7:
            raise OSError("this holder is gone")
        out[:] = shards.read(*key)
        return out.size

    def use(experts):
        for _ in cache.waves(layer, experts, obtain, 2):
            pass

    use([0, 1, 2, 3])
    use([0])  # 0 is now the most recently used
    use([4])  # evicts 1, the least recently used
    assert set(cache.slot_of) == {(layer, e) for e in (0, 2, 3, 4)}
    assert cache.stats.evicted == 1 and cache.stats.hits == 1
    with pytest.raises(OSError):
        use([7])
    assert len(cache.free) + len(cache.slot_of) == cache.slots and not cache.pinned
    assert np.array_equal(cache.record((layer, 4)), shards.read(layer, 4))


def test_two_auditors_at_once_share_a_record_and_never_fill_the_arena(model):
    """Both threads want records 3 and 5 and three others; the one that loads one first serves
    the other (the cache holds all eight, so nothing is evicted and loaded again); each takes
    at most a quarter of the slots at a time, so neither waits for a free one."""
    shards = model.shard_set
    cache = RecordCache(_no_records(model), 8 * 4096)
    layer = model.config.moe_layers[0]
    loads: list[tuple] = []
    gate = threading.Barrier(2)

    def obtain(key, out):
        loads.append(key)
        out[:] = shards.read(*key)
        return out.size

    seen: dict[str, list] = {}

    def auditor(name, experts):
        gate.wait()
        got = []
        for arena, offsets in cache.waves(layer, experts, obtain, cache.slots // 4):
            for e, at in offsets.items():  # the bytes it was given are the record
                assert np.array_equal(arena[at : at + shards.record_nbytes], shards.read(layer, e))
                got.append(e)
        seen[name] = got

    threads = [
        threading.Thread(target=auditor, args=("a", [5, 0, 1, 2, 3])),
        threading.Thread(target=auditor, args=("b", [5, 4, 6, 7, 3])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(seen["a"]) == [0, 1, 2, 3, 5] and sorted(seen["b"]) == [3, 4, 5, 6, 7]
    assert loads.count((layer, 5)) == 1 and loads.count((layer, 3)) == 1, loads
    assert not cache.pinned and not cache.loading


def test_the_default_budget_holds_a_small_model_whole():
    assert default_budget(24576, 24, 2) == 24 * 24576  # all of it
    big = default_budget(17_547_264, 93 * 896, 16)  # Kimi K3's records: two calls' worth
    assert big == 2 * 16 * 17_547_264  # (already a multiple of 4096)
