"""The committed demo model (models/demo-hf): it loads, and greedy decoding reproduces the
sample that transformers generated from it at the end of training (train_log.json)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local

DEMO = ROOT / "models" / "demo-hf"


@pytest.fixture(scope="module")
def demo_f32(tmp_path_factory):
    from moeshard.moe.convert.converter import convert

    out = tmp_path_factory.mktemp("demo") / "f32"
    convert(DEMO, out, "f32", "f32", progress=False)
    return out


def test_greedy_sample_matches_transformers(demo_f32):
    log = json.loads((DEMO / "train_log.json").read_text())
    sample = log["sample"]
    rt = open_local(demo_f32)
    prompt = rt.encode(sample["prompt"])
    assert prompt[0] == rt.eos_ids[0]  # the tokenizer starts a text with <|endoftext|>
    result = generate(rt.transformer, prompt, SamplingOptions(max_tokens=40))
    text = sample["prompt"] + rt.decode(result.tokens)
    assert text == sample["text"]


def test_demo_model_size_and_files():
    assert (DEMO / "model.safetensors").stat().st_size <= 25_000_000
    for name in ("config.json", "tokenizer.json", "generation_config.json", "loss.png", "val.txt"):
        assert (DEMO / name).exists(), name
