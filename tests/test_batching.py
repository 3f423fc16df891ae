"""Continuous batching's forward pass (`Transformer.forward_batch`): several sequences, each
with its own cache, in one pass; a sequence's logits are the same bits as when it runs alone,
whatever else is in the batch (prefill rows beside decode rows, any lengths)."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.coordinator.runtime import open_local
from moeshard.moe.kernels import quant


@pytest.fixture(scope="module")
def demo(demo):
    """The session's demo model, open (this module's own: its tests run it)."""
    return open_local(demo).transformer


def alone(model, steps):
    """Logits of one sequence fed `steps` (lists of ids) one forward call each."""
    cache = model.new_cache(64)
    return [model.forward(np.array(ids), cache) for ids in steps]


@pytest.mark.parametrize("attention", ["split", "one-thread"])
def test_a_sequence_in_a_batch_gets_its_alone_bits(demo, attention, monkeypatch):
    """(attention: the sequences' attention split among the threads however little work it
    is, or on the calling thread, as batches this small are by default)"""
    if attention == "split":
        monkeypatch.setattr(quant, "PARALLEL_MIN_WORK", 0)
    prompts = [[1, 5, 9, 2, 7], [42], [100, 200, 300], [7, 7, 7, 7, 7, 7, 7, 7]]
    follow = [[11], [12], [13], [14]]
    want = [alone(demo, [p, f, f]) for p, f in zip(prompts, follow, strict=True)]
    caches = [demo.new_cache(64) for _ in prompts]
    # step 1: two prefills together; step 2: their decode rows beside two other prefills;
    # step 3: four decode rows
    first = demo.forward_batch(
        [(np.array(prompts[0]), caches[0]), (np.array(prompts[1]), caches[1])]
    )
    second = demo.forward_batch(
        [(np.array(follow[0]), caches[0]), (np.array(prompts[2]), caches[2]),
         (np.array(follow[1]), caches[1]), (np.array(prompts[3]), caches[3])]
    )  # fmt: skip
    third = demo.forward_batch([(np.array(f), c) for f, c in zip(follow, caches, strict=True)])
    np.testing.assert_array_equal(first[0], want[0][0])
    np.testing.assert_array_equal(first[1], want[1][0])
    np.testing.assert_array_equal(second[0], want[0][1])
    np.testing.assert_array_equal(second[1], want[2][0])
    np.testing.assert_array_equal(second[2], want[1][1])
    np.testing.assert_array_equal(second[3], want[3][0])
    for s in range(4):
        step = 2 if s < 2 else 1
        np.testing.assert_array_equal(third[s], want[s][step])


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    from moeshard.moe.convert.synth import synth

    out = tmp_path_factory.mktemp("batching") / "k3"
    synth(out, "k3")  # MXFP4 experts, every K3 part
    return out


@pytest.mark.parametrize(
    "family",
    [
        "deepseek_v3",
        "kimi_linear",
        "olmoe",
        "kimi_k3",
        "glm4_moe",
        "glm4_moe_lite",
        "qwen3_next",
        "qwen3_5_moe",
    ],
)
def test_every_family_batches_with_alone_bits(family, converted, k3):
    """A prefill beside decode rows and other prefills, for each family's forward_batch."""
    path = k3 if family == "kimi_k3" else converted(family, experts="q4_0", trunk="bf16")
    model = open_local(path).transformer
    vocab = model.config.vocab_size
    prompts = [[1, 5, 9, 2, 7], [42 % vocab], [100 % vocab, 200 % vocab, 30]]
    want = [alone(model, [p, [11]]) for p in prompts]
    caches = [model.new_cache(64) for _ in prompts]
    first = model.forward_batch([(np.array(prompts[0]), caches[0])])
    second = model.forward_batch(
        [(np.array([11]), caches[0]), (np.array(prompts[1]), caches[1]),
         (np.array(prompts[2]), caches[2])]
    )  # fmt: skip
    third = model.forward_batch([(np.array([11]), caches[1]), (np.array([11]), caches[2])])
    np.testing.assert_array_equal(first[0], want[0][0])
    np.testing.assert_array_equal(second[0], want[0][1])
    np.testing.assert_array_equal(second[1], want[1][0])
    np.testing.assert_array_equal(second[2], want[2][0])
    np.testing.assert_array_equal(third[0], want[1][1])
    np.testing.assert_array_equal(third[1], want[2][1])


def family_model(family: str, demo, converted, k3):
    """The Transformer of `family`: the embedded model for qwen3_moe, else a converted
    fixture (k3: the synthetic K3)."""
    if family == "qwen3_moe":
        return demo
    path = k3 if family == "kimi_k3" else converted(family, experts="q4_0", trunk="bf16")
    return open_local(path).transformer


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3", "qwen3_next", "qwen3_5_moe"]
)
def test_last_only_gives_the_last_rows_bits(family, demo, converted, k3):
    """`forward_batch(..., last_only=True)` (what sampling reads: no LM head over a prompt's
    other rows) gives each sequence's last row of the full logits, bit for bit, and
    `forward(..., last_only=True)` the last token's."""
    model = family_model(family, demo, converted, k3)
    vocab = model.config.vocab_size
    prompts = [[1, 5, 9, 2, 7], [42 % vocab], [100 % vocab, 200 % vocab, 30]]

    def run(last_only: bool):
        caches = [model.new_cache(64) for _ in prompts]
        first = model.forward_batch(
            [(np.array(p), c) for p, c in zip(prompts, caches, strict=True)], last_only
        )
        then = model.forward_batch([(np.array([11]), c) for c in caches], last_only)
        return first, then

    (full_first, full_then), (last_first, last_then) = run(False), run(True)
    for full, last in zip(full_first + full_then, last_first + last_then, strict=True):
        assert last.shape == (1, vocab)
        np.testing.assert_array_equal(last, full[-1:])
    cache = model.new_cache(64)
    alone = model.forward(np.array(prompts[0]), cache, last_only=True)
    np.testing.assert_array_equal(alone, full_first[0][-1:])


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3", "qwen3_next", "qwen3_5_moe"]
)
def test_a_prompt_fed_in_pieces_gives_its_whole_logits(family, demo, converted, k3):
    """The serving engine feeds a long prompt in pieces (`Engine.prefill_chunk`): a piece
    after the first continues from the cache the earlier ones filled (KV, latent or KDA
    state), and the logits are the prompt's read at once."""
    model = family_model(family, demo, converted, k3)
    vocab = model.config.vocab_size
    prompt = np.array([1, 5, 9, 2, 7, 11, 13, 17, 19, 23], dtype=np.int64) % vocab
    whole = model.forward(prompt, model.new_cache(64))  # [10, V]
    for cut in ([3], [3, 6], [1, 2, 9]):
        cache = model.new_cache(64)
        pieces = np.split(prompt, cut)
        got = np.concatenate([model.forward(p, cache) for p in pieces])  # [10, V]
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
        if family == "qwen3_moe":  # (GQA attention reads the cache as it reads its own rows)
            np.testing.assert_array_equal(got, whole)
