"""Quality measurement helpers: evaluation windows, agreement/KL, perplexity."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.coordinator.quality import eval_windows, log_softmax


@pytest.mark.parametrize("n, window", [(10, 4), (256, 256), (1000, 256), (3, 8), (513, 256)])
def test_every_token_after_the_first_is_scored_exactly_once(n, window):
    scored = []
    for start, first in eval_windows(n, window):
        end = min(start + window, n)
        assert end - start <= window
        scored += list(range(start + 1 + first, end))  # targets predicted in this window
    assert sorted(scored) == list(range(1, n))


def test_log_softmax_is_normalised():
    logp = log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]], np.float32))
    assert np.allclose(np.exp(logp).sum(-1), 1.0)


def test_quality_command_reports_agreement(capsys):
    from helpers import FIXTURES

    from moeshard.cli import main

    args = ["quality", str(FIXTURES / "qwen3_moe"), "--prompt-ids", "294,221,81,85"]
    assert main(args + ["--tokens", "8", "--experts", "q8_0,f32"]) == 0
    out = capsys.readouterr().out
    f32_row = [line for line in out.splitlines() if line.split()[:2] == ["f32", "f32"]]
    assert f32_row and "100.00%" in f32_row[0]  # f32 against itself: identical
