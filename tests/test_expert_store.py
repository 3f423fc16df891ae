"""ExpertStore: outputs identical to the unbounded backend for every policy, size and prefetch."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.experts.usage import read_usage, write_profile
from moeshard.moe.model.model_dir import ModelDir

PROMPT = [3, 17, 42, 5, 99, 7]


def run(model: ModelDir, experts, max_tokens: int = 6):
    tf = model.family.Transformer(model.config, model.load_trunk(), experts)
    opts = SamplingOptions(max_tokens=max_tokens, keep_logits=True)
    return generate(tf, PROMPT, opts)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, converted):
    return ModelDir(converted(request.param, experts="q4_0"))


@pytest.fixture(scope="module")
def baseline(model):
    return run(model, LocalExperts(model.shard_set))


def test_identical_across_policies_sizes_and_prefetch(model, baseline):
    c = model.config
    n_all = c.n_experts * len(c.moe_layers)
    for policy in ("lru", "lfu", "pin", "none"):
        for prefetch in (True, False):
            minimum = 1 + (c.top_k if prefetch else 0)
            for slots in (minimum, minimum + 2, n_all + c.top_k):
                profile = None
                if policy == "pin":
                    profile = read_profile_from(model)
                store = ExpertStore(
                    model.shard_set,
                    slots,
                    model.config.top_k,
                    policy,
                    prefetch=prefetch,
                    profile=profile,
                    record_accesses=True,
                )
                result = run(model, store)
                store.close()
                assert result.tokens == baseline.tokens, (policy, prefetch, slots)
                for a, b in zip(result.logits, baseline.logits, strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=str((policy, prefetch, slots)))
                s = store.snapshot()
                # the routing the run recorded: every (layer, expert) use of every layer call
                used = [(layer, e) for layer, experts in store.accesses for e in experts]
                distinct = len(set(used))
                reads = s.bytes_read // store.record_nbytes  # records read
                assert s.hits + s.misses == len(used), (policy, prefetch, slots)
                if not prefetch:  # a record's first use is a miss, and a miss is a read
                    assert s.misses >= distinct and reads == s.misses, (policy, slots)
                if slots >= n_all + c.top_k and policy != "none":
                    # everything fits: each record read once, when first needed or predicted
                    assert distinct <= reads <= n_all, (policy, prefetch, slots)
                    if not prefetch:
                        assert (s.misses, s.hits) == (distinct, len(used) - distinct), policy


def read_profile_from(model):
    store = ExpertStore(model.shard_set, 4, model.config.top_k, "lru", prefetch=False)
    run(model, store, max_tokens=3)
    store.close()
    return store.counts


def test_cache_hits_and_prefetch_stats(model):
    c = model.config
    store = ExpertStore(
        model.shard_set,
        c.n_experts * len(c.moe_layers) + c.top_k,
        model.config.top_k,
        "lru",
        prefetch=True,
    )
    run(model, store)
    s = store.snapshot()
    store.close()
    assert s.hit_rate > 0.5
    assert 0.0 < s.recall <= 1.0 and 0.0 < s.precision <= 1.0
    assert s.bytes_read % store.record_nbytes == 0  # mispredicted prefetches also read
    assert s.bytes_read >= (s.misses + s.prefetch_hits) * store.record_nbytes


def test_prefetch_top_predicts_fewer_and_changes_nothing(model, baseline):
    """prefetch_top=1: each decode hint names at most one expert per token (the router's best
    guess); the output is the same bit for bit; a top outside 1..k is refused."""
    c = model.config
    store = ExpertStore(
        model.shard_set, 1 + 2 * c.top_k, model.config.top_k, "lru", prefetch=True, prefetch_top=1
    )
    hints = []
    real_prefetch = store.prefetch
    store.prefetch = lambda layer, ids: (hints.append(len(ids)), real_prefetch(layer, ids))
    result = run(model, store)
    s = store.snapshot()
    store.close()
    assert result.tokens == baseline.tokens
    for a, b in zip(result.logits, baseline.logits, strict=True):
        np.testing.assert_array_equal(a, b)
    decode_hints = hints[-(len(c.moe_layers) - 1) :]  # the last token's hints: one row each
    assert decode_hints and all(n == 1 for n in decode_hints)
    assert s.predicted > 0 and s.precision > 0
    for bad in (0, c.top_k + 1):
        with pytest.raises(MoeshardError, match="prefetch top"):
            ExpertStore(
                model.shard_set,
                1 + 2 * c.top_k,
                model.config.top_k,
                "lru",
                prefetch=True,
                prefetch_top=bad,
            )


def test_none_policy_reads_every_use(model):
    store = ExpertStore(model.shard_set, 8, model.config.top_k, "none", prefetch=False)
    run(model, store, max_tokens=3)
    s = store.snapshot()
    store.close()
    assert s.hits == 0 and s.misses == s.accesses


def test_profile_roundtrip(model, tmp_path):
    store = ExpertStore(model.shard_set, 8, model.config.top_k, "lru", prefetch=False)
    run(model, store, max_tokens=2)
    store.close()
    path = tmp_path / "profile.json"
    write_profile(path, model.model_id, store.counts)
    assert read_usage(path, model.model_id) == store.counts
    with pytest.raises(MoeshardError, match="another model"):
        read_usage(path, "f" * 64)


def test_pin_without_profile_refused(model):
    with pytest.raises(MoeshardError, match="profile"):
        ExpertStore(model.shard_set, 8, model.config.top_k, "pin")


def test_corrupted_record_names_expert(converted, tmp_path):
    src = converted("qwen3_moe", experts="q4_0")
    dst = tmp_path / "corrupt"
    shutil.copytree(src, dst)
    model = ModelDir(dst)
    layer, expert = 1, 5
    shard, loc = model.locations[(layer, expert)]
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + 10)
        byte = f.read(1)
        f.seek(loc.offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    store = ExpertStore(model.shard_set, 4, model.config.top_k, "lru", prefetch=False)
    hidden = np.ones((1, model.config.hidden_size), np.float32)  # [1, H]
    ids = np.array([[expert, 0]])  # [1, k]
    weights = np.array([[0.5, 0.5]], np.float32)  # [1, k]
    with pytest.raises(StoreError, match=r"experts-00000.gguf.*expert 5 of layer 1"):
        store(layer, hidden, ids, weights)
    store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "pin", "none"])
def test_a_replay_of_the_run_has_the_store_hits(model, policy):
    """The replays (`coact`, `simulate`) score records with the store's own policy module:
    replaying the layer calls of a real run gives exactly the store's hits, at several sizes."""
    from moeshard.moe.analysis.cachesim import policy_hits

    c = model.config
    counts = None
    if policy == "pin":  # a profile of the same prompt, from a first run
        first = ExpertStore(model.shard_set, 64, c.top_k, "lru", prefetch=False)
        run(model, first)
        counts = first.counts
        first.close()
    hits = {}
    for slots in (3, 6, 11):
        store = ExpertStore(
            model.shard_set, slots, c.top_k, policy, prefetch=False, profile=counts,
            record_accesses=True,
        )  # fmt: skip
        run(model, store)
        calls = [[layer * c.n_experts + e for e in experts] for layer, experts in store.accesses]
        pinned = {layer * c.n_experts + e for layer, e in store.scores.pinned}
        hits[slots] = store.snapshot().hits
        assert policy_hits(calls, slots, policy, pinned) == hits[slots], slots
        store.close()
    assert hits[11] > 0 or policy == "none"  # the comparison was not of empty runs
