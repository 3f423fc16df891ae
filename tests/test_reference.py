"""Model math against Hugging Face transformers' own outputs (committed by tools/make_fixtures.py).

For every family, in both config.json dialects, with f32 experts and trunk: the prompt's logits
match within 1e-4 of the logit range, and the 24-token greedy continuation is identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DIALECTS, FAMILY_FIXTURES, reference

from moeshard.cli import main
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local

TOLERANCE = 1e-4  # max abs error relative to the reference logit range


def test_every_family_has_a_fixture():
    required = {"deepseek_v3", "deepseek_v3_fp8", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"}
    required |= {"glm4_moe", "glm4_moe_lite"}
    assert required <= set(FAMILY_FIXTURES)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_matches_transformers(name, dialect, converted):
    ref = reference(name)
    rt = open_local(converted(name, dialect))
    cache = rt.transformer.new_cache(64)
    logits = rt.transformer.forward(ref["prompt_ids"], cache)  # [T, V]
    span = float(ref["prefill_logits"].max() - ref["prefill_logits"].min())
    error = float(np.abs(logits - ref["prefill_logits"]).max())
    assert error <= TOLERANCE * span, f"prefill logits off by {error} (range {span})"

    result = generate(
        rt.transformer,
        [int(t) for t in ref["prompt_ids"]],
        SamplingOptions(max_tokens=len(ref["greedy_ids"]), keep_logits=True),
    )
    assert result.tokens == [int(t) for t in ref["greedy_ids"]]
    step_error = float(np.abs(np.stack(result.logits) - ref["greedy_logits"]).max())
    assert step_error <= TOLERANCE * span


@pytest.mark.parametrize(
    "name",
    [
        "deepseek_v3",
        "qwen3_moe",
        "kimi_linear",
        "gpt_oss",
        "glm4_moe",
        "glm4_moe_lite",
        "qwen3_next",
        "qwen3_5_moe",
        "kimi_k25",
    ],
)
def test_kv_cache_equals_recompute(name, converted):
    """Decoding with the cache gives the logits of re-running the whole sequence from scratch."""
    ref = reference(name)
    rt = open_local(converted(name))
    prompt = [int(t) for t in ref["prompt_ids"]]
    result = generate(rt.transformer, prompt, SamplingOptions(max_tokens=12, keep_logits=True))
    sequence = np.asarray(prompt + result.tokens[:-1])
    full = rt.transformer.forward(sequence, rt.transformer.new_cache(len(sequence)))  # [S, V]
    recomputed = full[len(prompt) - 1 :]  # the logits each generated token was chosen from
    np.testing.assert_allclose(np.stack(result.logits), recomputed, atol=1e-4, rtol=0)


def test_cli_json_and_dump_logits(converted, tmp_path, capsys):
    ref = reference("qwen3_moe")
    model = converted("qwen3_moe")
    ids = ",".join(str(int(t)) for t in ref["prompt_ids"])
    dump = tmp_path / "logits.npy"
    code = main(
        ["generate", str(model), "--prompt-ids", ids, "--max-tokens", "24", "--json"]
        + ["--dump-logits", str(dump)]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == [int(t) for t in ref["prompt_ids"]]
    assert out["tokens"] == [int(t) for t in ref["greedy_ids"]]
    assert isinstance(out["text"], str) and out["stats"]["decode_s_per_token"] > 0
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape == ref["greedy_logits"].shape
    assert np.abs(logits - ref["greedy_logits"]).max() < 1e-3


def test_cli_streams_text_and_stops_at_eos(converted, capsys):
    model = converted("qwen3_moe")
    code = main(["generate", str(model), "--prompt", "the model", "--max-tokens", "8"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.strip() != ""
    assert "tokens at" in captured.err


def test_sampling_is_seeded(converted, capsys):
    model = converted("mixtral")
    args = ["generate", str(model), "--prompt-ids", "5,6,7", "--max-tokens", "10", "--json"]
    args += ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.9"]
    runs = []
    for seed in ("3", "3", "4"):
        assert main(args + ["--seed", seed]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
