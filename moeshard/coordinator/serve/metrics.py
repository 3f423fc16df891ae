"""`GET /metrics` and `/health`'s body: the server's counters in Prometheus' text format
(every label value escaped: a node's name is a stranger's text)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeshard.coordinator.serve.app import ServerState


def jsonable(value):
    """The experts backend's stats as JSON (numbers, strings, lists and dicts of them)."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return {}


def label_value(value: Any) -> str:
    """`value` as a Prometheus label value: backslash, double quote and line feed escaped,
    as the text exposition format wants (a node's name is a stranger's text: unescaped, a
    line feed in it would start a sample line of its own)."""
    text = str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(state: ServerState) -> str:
    """The counters and gauges in Prometheus' text format."""
    e = state.engine
    s = e.stats
    up = max(time.time() - state.started, 1e-9)
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"])

    metric("moeshard_requests_total", "counter", "requests accepted",
           state.metrics.get("moeshard_requests_total", 0))  # fmt: skip
    metric("moeshard_requests_rejected_total", "counter", "requests refused: queue full",
           state.metrics.get("moeshard_requests_rejected_total", 0))  # fmt: skip
    name = "moeshard_requests_finished_total"
    why = "eos; length; cancelled: the client left or a stop sequence ended the text; error"
    lines += [f"# HELP {name} requests ended, by why ({why})", f"# TYPE {name} counter"]
    for reason, n in sorted(dict(s.finished_by).items()):
        lines.append(f'{name}{{reason="{label_value(reason)}"}} {n}')
    metric("moeshard_prompt_tokens_total", "counter", "prompt tokens in", s.prompt_tokens)
    metric("moeshard_generated_tokens_total", "counter", "tokens out", s.generated_tokens)
    metric("moeshard_tokens_per_second", "gauge", "tokens out per second of engine work",
           s.generated_tokens / s.busy_s if s.busy_s else 0.0)  # fmt: skip
    metric("moeshard_uptime_seconds", "gauge", "seconds since start", up)
    metric("moeshard_queue_depth", "gauge", "requests waiting for a slot", e.queue_depth())
    metric("moeshard_batch_size", "gauge", "sequences running now", e.running())
    guard = state.guard
    if guard is not None:
        metric("moeshard_http_connections", "gauge", "client connections open", guard.count())
        metric("moeshard_http_connections_timed_out_total", "counter",
               "connections closed for not sending a request's headers or body in time",
               guard.timed_out)  # fmt: skip
        metric("moeshard_http_connections_evicted_total", "counter",
               "connections still reading a request closed at the cap for a newer one",
               guard.evicted)  # fmt: skip
        metric("moeshard_http_connections_refused_total", "counter",
               "connections closed at once: at the cap, every open one being answered",
               guard.refused)  # fmt: skip
    metric("moeshard_batch_size_mean", "gauge", "sequences per step, mean",
           s.batch_rows / s.steps if s.steps else 0.0)  # fmt: skip
    lines += s.first_token.prometheus(
        "moeshard_time_to_first_token_seconds", "from a request's arrival to its first token"
    )
    lines += s.inter_token.prometheus(
        "moeshard_inter_token_latency_seconds", "between a request's successive tokens"
    )
    lines += s.request_time.prometheus(
        "moeshard_request_duration_seconds", "from a request's arrival to its end, whatever why"
    )
    if getattr(s, "held", None) is not None and s.held.snapshot()[2]:  # nodes, audited
        lines += s.held.prometheus(
            "moeshard_token_audit_wait_seconds",
            "from a token being made to its being sent: the audits it rests on settling",
        )
        metric("moeshard_rollbacks_total", "counter", "sequences undone: a node caught lying",
               s.rollbacks)  # fmt: skip
    stats = state.experts.stats() if state.experts is not None else {}
    hits, misses = stats.get("hits"), stats.get("misses")
    if hits is not None and misses is not None and hits + misses:
        metric("moeshard_expert_cache_hit_ratio", "gauge", "expert cache hits / lookups",
               hits / (hits + misses))  # fmt: skip
    nodes = [n for n in stats.get("nodes", []) or [] if n.get("mean_ms", n.get("ewma_ms"))]
    if nodes:
        name = "moeshard_node_call_latency_ms"
        lines += [f"# HELP {name} smoothed round trip of a call to the node",
                  f"# TYPE {name} gauge"]  # fmt: skip
    for node in nodes:
        label = label_value(node.get("name") or node.get("addr", "?"))
        lines.append(f'{name}{{node="{label}"}} {node.get("mean_ms", node.get("ewma_ms")):g}')
    return "\n".join(lines) + "\n"
