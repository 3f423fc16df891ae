"""`moeshard bench modes MODEL --ram SIZE`: the in-RAM default against `--ram` streaming.

On a model that fits in RAM the default mode (`open_local`: trunk and experts in RAM) should be
no slower than streaming under a budget that also holds everything (`open_streaming`): both run
a decode step's experts through the one compute path. Both runtimes are opened once and
warmed with one generation; then rounds alternate between them (so a drifting shared machine
affects both alike), each round greedy-decoding the same prompt. Prints each mode's median
decode tok/s over the rounds and their ratio, and checks that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.errors import MoeshardError
from moeshard.moe.units import fmt_bytes, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (with trunk)")
    p.add_argument("--ram", required=True, help="budget of the streaming mode, e.g. 2G")
    p.add_argument("--tokens", type=int, default=48, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds per mode")
    p.add_argument(
        "--prompt-ids", default="1,2,3,4,5,6,7,8", help="prompt as comma-separated token ids"
    )


def _round(rt, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s of one greedy generation, and its tokens."""
    result = generate(rt.transformer, prompt, SamplingOptions(max_tokens=tokens + 1))
    return len(result.decode_s) / sum(result.decode_s), result.tokens


def run(args) -> int:
    if args.tokens < 1 or args.rounds < 1:
        raise MoeshardError("--tokens and --rounds must be at least 1")
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    except ValueError:
        raise MoeshardError(
            f"--prompt-ids: not a comma-separated list: {args.prompt_ids}"
        ) from None
    budget = parse_size(args.ram)
    modes = {
        "in RAM (default)": open_local(args.model),
        f"--ram {args.ram} (streaming)": open_streaming(
            args.model, budget, len(prompt) + args.tokens + 1, prefill_tokens=len(prompt)
        ),
    }
    plan = modes[f"--ram {args.ram} (streaming)"].plan
    print(
        f"{args.model}: {args.rounds} alternated rounds of {args.tokens} greedy decode steps "
        f"after a {len(prompt)}-token prompt; --ram {fmt_bytes(budget)}: "
        f"{plan.expert_slots} expert slots, trunk "
        f"{'resident' if plan.trunk_resident else 'streamed'}"
    )
    rates: dict[str, list[float]] = {name: [] for name in modes}
    outputs: dict[str, list[int]] = {}
    for name, rt in modes.items():  # warm: JIT, first reads, caches filled
        _, outputs[name] = _round(rt, prompt, args.tokens)
    started = time.perf_counter()
    for _ in range(args.rounds):
        for name, rt in modes.items():
            rate, tokens = _round(rt, prompt, args.tokens)
            rates[name].append(rate)
            if tokens != outputs[name]:
                raise MoeshardError(f"{name}: tokens changed between rounds")
    print(f"{'mode':<28} {'tok/s median':>12} {'min':>8} {'max':>8}")
    for name, values in rates.items():
        print(
            f"{name:<28} {statistics.median(values):>12.1f} {min(values):>8.1f} {max(values):>8.1f}"
        )
    local, streaming = (statistics.median(v) for v in rates.values())
    same = len(set(map(tuple, outputs.values()))) == 1
    print(
        f"in RAM / streaming: {local / streaming:.2f}x (median tok/s); same tokens: "
        f"{'yes' if same else 'NO'}; {time.perf_counter() - started:.1f} s"
    )
    for rt in modes.values():
        rt.close()
    return 0 if same else 1
