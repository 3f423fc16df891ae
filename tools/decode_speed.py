"""Median decode tokens/s of a model in RAM, in this process: 5 greedy runs of 128 tokens from
a 3-token prompt, after a warm-up. For comparing two trees of the code on the same model
(run it from each tree's root, alternating):

    python tools/decode_speed.py MODEL_DIR
"""

from __future__ import annotations

import statistics
import sys

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local


def main() -> None:
    model = open_local(sys.argv[1]).transformer
    generate(model, [1, 2, 3], SamplingOptions(max_tokens=8))  # warm: JIT, caches, first touches
    rates = []
    for _ in range(5):
        run = generate(model, [1, 2, 3], SamplingOptions(max_tokens=129))
        rates.append(len(run.decode_s) / sum(run.decode_s))
    print(f"{statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
