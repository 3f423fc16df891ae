"""Per-token statistics and the live progress line of a streaming (`--ram`) generation."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

from moeshard.moe.experts.store import ExpertStore


class StreamMonitor:
    """Wraps the generate loop's on_token callback: after each token, the ExpertStore's counter
    deltas go to --stats-json (one JSON line per token) and a progress line to stderr.

    Made before the store (its `layer_done` is the store's `on_layer` callback), started once
    the store and the text streamer exist."""

    def __init__(self, stats_path: str | None = None, err: TextIO | None = None):
        self.err = err or sys.stderr  # (looked up per run: a default bound at import goes stale)
        self.out = open(stats_path, "w") if stats_path else None  # noqa: SIM115 (closed in finish)
        self.store: ExpertStore | None = None
        self.inner: Callable[[int], None] | None = None
        self.t_last = self.t0 = time.perf_counter()
        self.tokens = 0
        self.live = self.err.isatty()

    def start(self, store: ExpertStore, inner, prompt_tokens: int) -> None:
        self.store, self.inner = store, inner
        self.last = store.snapshot()
        self.err.write(f"[prefill: {prompt_tokens} tokens]\n")
        self.err.flush()
        self.t_last = self.t0 = time.perf_counter()

    def layer_done(self, layer: int) -> None:
        """During prefill on a terminal: which layer, how long, how much read."""
        if self.tokens or not self.live or self.store is None:
            return
        snap = self.store.snapshot()
        self.err.write(
            f"\r[prefill: layer {layer}, {time.perf_counter() - self.t0:.1f} s, "
            f"{snap.bytes_read / 1e9:.2f} GB read]"
        )
        self.err.flush()

    def __call__(self, token: int) -> None:
        now = time.perf_counter()
        snap = self.store.snapshot()
        delta = snap.minus(self.last)
        phase = "prefill" if self.tokens == 0 else "decode"
        line = {
            "token_index": self.tokens,
            "token": token,
            "phase": phase,
            "s": now - self.t_last,
            **{k: v for k, v in delta.as_dict().items()},
        }
        if self.out:
            self.out.write(json.dumps(line) + "\n")
        self.tokens += 1
        decode_s = (now - self.t0) / max(self.tokens - 1, 1) if self.tokens > 1 else line["s"]
        if self.tokens == 1:
            self.t0 = now
        if self.live:
            self.err.write(
                f"\r[{self.tokens} tokens, {decode_s:.3f} s/token, "
                f"{snap.bytes_read / 1e9:.2f} GB read, hit rate {snap.hit_rate:.0%}]"
            )
            self.err.flush()
        self.last, self.t_last = snap, now
        if self.inner:
            self.inner(token)

    def finish(self, summary: dict | None = None) -> None:
        if self.live:
            self.err.write("\n")
        if self.out:
            if summary is not None:
                self.out.write(json.dumps({"summary": summary}) + "\n")
            self.out.close()
