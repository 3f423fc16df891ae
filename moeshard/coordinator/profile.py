"""`generate --profile`: where a decode step's time goes (trunk, routing, experts, overhead)."""

from __future__ import annotations

import time

import numpy as np

from moeshard.moe.model.trunk import time_linear


class DecodeProfile:
    """Where a decode step's time goes (`moeshard generate --profile`), per token:

    * trunk: the forward pass less routing and experts: embedding, norms, attention
      projections, RoPE, attention, residual adds, dense and shared MLPs, final norm, lm_head
      ("linear" is the part of it spent in the trunk's linear layers);
    * routing: the routers, and the next layer's router run for the prefetch hint;
    * experts: the experts backend's calls (local kernels, the cache, or the nodes);
    * overhead: the rest of the step: sampling, the token callback, Python between.

    Only decode steps count (not the prefill). The timers are perf_counter_ns accumulators
    installed for the generation only (the model's `route` and `experts` wrapped, Linear's
    call timed, see `moeshard.moe.model.trunk.time_linear`), so a generation without --profile runs
    no timing code. A profiled decode takes the step-by-step path: a layer fused into one call
    (`moeshard.moe.model.fused_layer`) has no parts to time, so the profile's total is that of
    the unfused steps (the same tokens and bits)."""

    PARTS = ("trunk", "routing", "experts", "overhead")

    def __init__(self):
        self.totals = dict.fromkeys(("total", "forward", "routing", "experts", "linear"), 0)
        self.step = dict.fromkeys(("routing", "experts", "linear"), 0)
        self.tokens = 0  # decode steps timed
        self._t_step = self._t_forward = self._forward_ns = 0

    # -- installing the timers -------------------------------------------------------------

    def install(self, model) -> None:
        route = model.route  # the bound method (or whatever a caller set)
        step = self.step

        def timed_route(layer, h):
            t0 = time.perf_counter_ns()
            try:
                return route(layer, h)
            finally:
                step["routing"] += time.perf_counter_ns() - t0

        self._saved = (model.__dict__.get("route"), model.experts)
        model.fused_decode = False  # (the class's True again at uninstall)
        model.route = timed_route
        model.experts = _TimedExperts(model.experts, step)
        time_linear(self._linear)

    def uninstall(self, model) -> None:
        route, experts = self._saved
        time_linear(None)
        model.__dict__.pop("fused_decode", None)
        model.experts = experts
        if route is None:
            del model.route
        else:
            model.route = route

    def _linear(self, ns: int) -> None:
        self.step["linear"] += ns

    # -- one step --------------------------------------------------------------------------

    def begin_step(self) -> None:
        for key in self.step:
            self.step[key] = 0
        self._forward_ns = 0
        self._t_step = time.perf_counter_ns()

    def forward_started(self) -> None:
        self._t_forward = time.perf_counter_ns()

    def forward_done(self) -> None:
        self._forward_ns = time.perf_counter_ns() - self._t_forward

    def end_step(self, decode: bool) -> None:
        if not decode:
            return
        totals = self.totals
        totals["total"] += time.perf_counter_ns() - self._t_step
        totals["forward"] += self._forward_ns
        for key, ns in self.step.items():
            totals[key] += ns
        self.tokens += 1

    # -- the result ------------------------------------------------------------------------

    def summary(self) -> dict:
        """Milliseconds per decode token: total and its parts (trunk + routing + experts +
        overhead = total), trunk_linear (within trunk); JSON-able."""
        t, n = self.totals, max(self.tokens, 1)
        parts_ns = {
            "trunk": t["forward"] - t["routing"] - t["experts"],
            "routing": t["routing"],
            "experts": t["experts"],
            "overhead": t["total"] - t["forward"],
        }
        out = {"decode_tokens": self.tokens, "total_ms": t["total"] / n / 1e6}
        out.update({f"{k}_ms": v / n / 1e6 for k, v in parts_ns.items()})
        out["trunk_linear_ms"] = t["linear"] / n / 1e6
        return out


def format_profile(p: dict) -> str:
    """`DecodeProfile.summary()` as a short table (generate --profile prints it on stderr)."""
    total = p["total_ms"] or 1.0
    lines = [f"[profile: {p['decode_tokens']} decode tokens; ms per token]"]
    for part in DecodeProfile.PARTS:
        ms = p[f"{part}_ms"]
        note = ""
        if part == "trunk":
            note = f"  (linear layers {p['trunk_linear_ms']:.3f})"
        lines.append(f"  {part:<9} {ms:8.3f} {ms / total:6.1%}{note}")
    lines.append(f"  {'total':<9} {p['total_ms']:8.3f} {1:6.1%}")
    return "\n".join(lines)


class _TimedExperts:
    """An experts backend whose calls are timed into step["experts"]; every other attribute
    is the wrapped backend's (so `moeshard.moe.model.layers.uses_hints` answers for it)."""

    def __init__(self, inner, step: dict):
        self.inner, self._step = inner, step

    def __call__(self, layer, hidden, ids, weights, dtype=np.float32, hint=None):
        t0 = time.perf_counter_ns()
        try:
            return self.inner(layer, hidden, ids, weights, dtype, hint=hint)
        finally:
            self._step["experts"] += time.perf_counter_ns() - t0

    def resident(self, layer: int):
        """None: a decode row's experts stay a call of their own, so they can be timed
        (`decode_layers` would run them inside the attention's kernel call)."""
        return None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
