"""Shared fixtures: the committed Hugging Face reference checkpoints and their conversions, and
a cluster of node daemons on loopback. Plain helpers and constants are in helpers.py."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest
from helpers import PROMPT, ROOT, TOKENS, checkpoint_in_dialect, start_nodes

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe import sigint
from moeshard.moe.convert.converter import convert
from moeshard.moe.convert.placement import shard_model

# The suite runs as a terminal's foreground command, whatever started it. A CI job or
# `make test &` starts it with SIGINT ignored, and moeshard keeps an inherited ignored SIGINT
# ignored (`moe.sigint`): the in-process signal tests would find their handlers not set.
signal.signal(signal.SIGINT, signal.default_int_handler)
sigint.IGNORED = False

# Keys, ledgers and reputations the tests' processes make by default stay out of the real home.
os.environ["MOESHARD_HOME"] = tempfile.mkdtemp(prefix="moeshard-test-home-")


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Path:
    """The committed demo model (models/demo-hf) converted as `make demo` converts it (q4_0
    experts, bf16 trunk), once for the session. Tests read it and never change it; one that
    changes a model directory converts or copies its own. (A module that wants the model
    open overrides this fixture with its own `demo(demo)`.)"""
    out = tmp_path_factory.mktemp("demo") / "model"
    convert(ROOT / "models" / "demo-hf", out, progress=False)
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(fixture, dialect, experts, trunk) -> model directory (converted once)."""
    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple, Path] = {}

    def get(name: str, dialect: str = "rope_theta", experts: str = "f32", trunk: str = "f32"):
        key = (name, dialect, experts, trunk)
        if key not in done:
            src = checkpoint_in_dialect(name, dialect, root)
            out = root / "-".join(key)
            convert(src, out, experts, trunk, progress=False)
            done[key] = out
        return done[key]

    return get


# -- a cluster on loopback (test_cluster.py, test_discovery.py) -------------------------------


@pytest.fixture(scope="module")
def cluster_model(converted):
    """The model the cluster serves: qwen3_moe with f32 experts."""
    return converted("qwen3_moe")


@pytest.fixture(scope="module")
def cluster_plan(cluster_model, tmp_path_factory):
    """The model's experts placed on three nodes, two replicas each."""
    return shard_model(cluster_model, 3, 2, tmp_path_factory.mktemp("shard") / "cluster")


@pytest.fixture(scope="module")
def cluster(cluster_plan):
    """Three `moeshard node` processes serving the plan's shards (advertised with zeroconf).
    A test that kills or restarts one puts a live one back in the list before it returns."""
    nodes = start_nodes([n["dir"] for n in cluster_plan["nodes"]])
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(scope="module")
def cluster_reference(cluster_model):
    """PROMPT continued for TOKENS tokens on one machine, logits kept."""
    rt = open_local(cluster_model)
    return generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True))
