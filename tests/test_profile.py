"""`generate --profile` (issue 17): where a decode token's time goes. The parts add up to the
total, the experts and the trunk's linear layers are really timed, the timers leave nothing
behind, and profiling does not change a token."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moeshard.coordinator.generate import DecodeProfile, SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.model.trunk import Linear
from tests.helpers import ROOT

DEMO = ROOT / "models" / "demo-hf"
PROMPT_IDS = [7, 42, 199, 3, 88]
TOKENS = 12


def test_profile_parts_add_up_and_change_no_token(demo):
    rt = open_local(demo)
    opts = SamplingOptions(max_tokens=TOKENS)
    untimed_call, route = Linear.__call__, rt.transformer.route
    plain = generate(rt.transformer, PROMPT_IDS, opts)
    timed = generate(rt.transformer, PROMPT_IDS, opts, profile=True)
    assert timed.tokens == plain.tokens
    assert plain.profile is None
    p = timed.profile
    assert p["decode_tokens"] == TOKENS - 1  # the prefill step is not a decode token
    parts = [p[f"{name}_ms"] for name in DecodeProfile.PARTS]
    assert all(ms >= 0 for ms in parts), p
    assert sum(parts) == pytest.approx(p["total_ms"], rel=1e-9)
    assert p["experts_ms"] > 0 and p["routing_ms"] > 0, p  # both were wrapped and called
    assert 0 < p["trunk_linear_ms"] <= p["trunk_ms"], p
    # the timers are gone again: Linear's call and the model's route are the untimed ones
    assert Linear.__call__ is untimed_call
    assert "route" not in vars(rt.transformer) and rt.transformer.route == route
    # (a profiled decode took the step-by-step path; the fused layer is back on)
    assert "fused_decode" not in vars(rt.transformer) and rt.transformer.fused_decode
    assert type(rt.transformer.experts).__name__ != "_TimedExperts"


def test_profile_is_undone_when_the_generation_fails(demo):
    rt = open_local(demo)
    untimed_call = Linear.__call__
    with pytest.raises(IndexError):  # a token id beyond the vocabulary: the forward fails
        generate(rt.transformer, [10**9], SamplingOptions(max_tokens=2), profile=True)
    assert Linear.__call__ is untimed_call
    assert "route" not in vars(rt.transformer)


def test_generate_profile_prints_the_table_and_the_json(demo):
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "generate", str(demo), "--prompt",
         "The function returns", "--max-tokens", "6", "--profile", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    profile = json.loads(proc.stdout)["stats"]["profile"]
    assert profile["decode_tokens"] == 5
    assert np.isclose(
        sum(profile[f"{k}_ms"] for k in DecodeProfile.PARTS), profile["total_ms"], rtol=1e-9
    )
    table = proc.stderr[proc.stderr.index("[profile:") :]
    for part in (*DecodeProfile.PARTS, "total", "linear layers"):
        assert part in table, table
