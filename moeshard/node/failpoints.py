"""Fault injection for tests: make a node lie, on purpose, at a rate. Off unless set.

`MOESHARD_FAILPOINTS="lie=MODE:RATE"` (for example `lie=nan:1.0`, `lie=scale:1.01:0.2`), read
once at start. A Forward reply is altered with probability RATE (default 1):
  zero          every value 0
  scale:F       every value times F
  noise:S       Gaussian noise of standard deviation S added
  nan           every value NaN
  ulp           one value, picked at random, moved by one unit in its last place
  wrong_expert  the rows computed with another expert this node holds
  duplicate     the reply sent twice on a stream
  forged_block  (possession challenges, not Forward) one byte of each block proof flipped
  forged_record (Record, not Forward) one byte of the record flipped in the chunks sent
  busy          not a lie: the Forward is refused RESOURCE_EXHAUSTED "node busy", as a node
                flooded by others would (at RATE: `busy:0.2`)
  late_proof:S  (possession challenges, not Forward) each answer held back S seconds, as a node
                fetching the bytes from elsewhere would be late
  crash:N       not a lie: the process exits (status 1, no reply) on its (N+1)-th Forward
                call, as a node dying in the middle of a generation
The testbed and the tests use it to check that the coordinator catches each kind of lie.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

import numpy as np

from moeshard.moe.errors import MoeshardError

log = logging.getLogger(__name__)

MODES = (
    "zero", "scale", "noise", "nan", "ulp", "wrong_expert", "duplicate", "forged_block",
    "forged_record", "late_proof", "busy", "crash",
)  # fmt: skip
ENV = "MOESHARD_FAILPOINTS"


@dataclass(frozen=True)
class Lie:
    mode: str  # one of MODES
    arg: float = 0.0  # scale's factor, noise's standard deviation
    rate: float = 1.0  # share of replies altered

    def fires(self, rng: random.Random) -> bool:
        return rng.random() < self.rate

    def alter(self, out: np.ndarray, rng: random.Random) -> np.ndarray:
        """The lying version of a float64 partial sum out [T, H]."""
        if self.mode == "zero":
            return np.zeros_like(out)
        if self.mode == "scale":
            return out * self.arg
        if self.mode == "noise":
            noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(out.shape)
            return out + self.arg * noise  # [T, H]
        if self.mode == "nan":
            return np.full_like(out, np.nan)
        if self.mode == "ulp" and out.size:
            lied = out.copy()  # [T, H]
            flat = lied.reshape(-1)
            i = rng.randrange(flat.size)
            flat[i] = np.nextafter(flat[i], np.inf)
            return lied
        return out

    def name(self) -> str:
        """As a failpoint spec names it, without the rate: `scale:1.01`, `zero`."""
        return f"{self.mode}:{self.arg:.10g}" if self.mode in ("scale", "noise") else self.mode


def parse(text: str | None) -> Lie | None:
    """The lie of a failpoint spec, or None; ValueError naming what is wrong."""
    if not text:
        return None
    name, _, spec = text.partition("=")
    if name.strip() != "lie":
        raise ValueError(f"{ENV}: unknown failpoint {name!r} (only 'lie=MODE[:ARG][:RATE]')")
    parts = spec.split(":")
    mode = parts[0]
    if mode not in MODES:
        raise ValueError(f"{ENV}: unknown lie {mode!r}; choose one of {', '.join(MODES)}")
    try:
        numbers = [float(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"{ENV}: {text!r}: not numbers after the mode") from None
    takes_arg = mode in ("scale", "noise", "crash", "late_proof")
    if takes_arg and not numbers:
        raise ValueError(f"{ENV}: lie {mode} needs a number ({mode}:F)")
    arg = numbers[0] if takes_arg else 0.0
    rate = numbers[1 if takes_arg else 0] if len(numbers) > int(takes_arg) else 1.0
    return Lie(mode, arg, rate)


def from_environment() -> Lie | None:
    """The lie set for this process, or None; a malformed spec is one line (exit 2)."""
    try:
        lie = parse(os.environ.get(ENV))
    except ValueError as exc:
        raise MoeshardError(str(exc)) from None
    if lie is not None:
        log.warning("FAILPOINT: this node lies (%s); for tests only", lie)
    return lie


def swapped(held: list[int], ids: np.ndarray) -> np.ndarray:
    """`wrong_expert`: each held expert id replaced by the next one held (others kept)."""
    swap = {e: held[(held.index(e) + 1) % len(held)] for e in held}
    return np.vectorize(lambda e: swap.get(int(e), int(e)))(ids)  # [T, used]
