"""Plan how a hard RAM budget is split at start-up: trunk, expert cache, KV cache, scratch.

Priority: the KV cache for the requested context and the scratch (activations) come first,
then the minimum working set (top_k expert slots of one layer + the prefetch slots, and either
the whole trunk or its always-resident part plus a ring of 2 layer slots), then resident trunk
layers (they are used by every token, so a byte of trunk saves more reads than a byte of
expert cache), and everything left becomes expert cache slots.

The interpreter's fixed overhead (RSS after imports and the numba warm-up, before any model
allocation) is measured and reported but is not part of the budget: the promise is
peak RSS <= budget + overhead.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import quant
from moeshard.moe.storage.io import align_up
from moeshard.moe.storage.trunk_file import TrunkLayout
from moeshard.moe.units import fmt_bytes

SCRATCH_FIXED = 48 << 20  # numpy/numba temporaries independent of the token count
TRUNK_RING = 2  # layer slots of a streamed trunk: the current layer and the next one


def rss_bytes() -> int:
    """Current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_overhead() -> int:
    """RSS of the interpreter with numpy, numba and our kernels loaded and warmed up."""
    quant.warmup()
    return rss_bytes()


def scratch_bytes(config, tokens: int, context: int) -> int:
    """Activations of one forward pass over `tokens` tokens with `context` keys (generous)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    per_token = (config.vocab_size + 12 * h + 2 * config.n_experts + config.top_k * h) * 4
    attention = heads * tokens * context * 4 * 2  # scores and probabilities [heads, T, S]
    return SCRATCH_FIXED + tokens * per_token + attention


def available_memory() -> int | None:
    """Bytes this process could still allocate: the kernel's MemAvailable, lowered to the
    room left under a cgroup v2 memory limit when there is one; None when neither is known."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_context(config, prompt_tokens: int, max_tokens: int, beyond: bool = False) -> None:
    """Refuse a generation longer than the model's context (`max_position_embeddings`): past
    it, positions the model never saw in training give text that silently degrades."""
    limit = getattr(config, "max_position_embeddings", None)
    total = prompt_tokens + max_tokens
    if limit and total > limit and not beyond:
        raise MoeshardError(
            f"--max-tokens {max_tokens}: the prompt ({prompt_tokens} tokens) + --max-tokens is "
            f"{total} tokens, beyond the model's context of {limit} (max_position_embeddings); "
            f"lower --max-tokens or pass --beyond-context"
        )


def cache_bytes(config, context: int) -> int:
    """The sequence's cache: KV (or latent) bytes per token for `context` tokens, plus the
    fixed-size state of recurrent layers (Kimi Linear's KDA: `state_bytes`)."""
    state = config.state_bytes() if hasattr(config, "state_bytes") else 0
    return config.kv_bytes_per_token() * context + state


def check_memory(model, context: int, prompt_tokens: int, remote: bool) -> None:
    """Refuse, before allocating anything, a run without --ram whose RAM need is larger than
    the memory available: the whole trunk, every expert (in-RAM mode reads them all sooner or
    later; with nodes they stay remote), the KV cache for `context` tokens and the scratch."""
    c = model.config
    kv = cache_bytes(c, context)
    scratch = scratch_bytes(c, prompt_tokens, context)
    trunk = TrunkLayout(model.path / "trunk.gguf", model.model_id).total_bytes()
    experts = 0 if remote else sum(os.path.getsize(shard.path) for shard in model.shards)
    need = kv + scratch + trunk + experts
    available = available_memory()
    if available is not None and need > available:
        fix = "lower --max-tokens" if remote else "use --ram SIZE to stream the experts"
        raise MoeshardError(
            f"this run needs {fmt_bytes(need)} of RAM (KV cache for {context} tokens "
            f"{fmt_bytes(kv)}, scratch {fmt_bytes(scratch)}, trunk {fmt_bytes(trunk)}"
            + ("" if remote else f", experts {fmt_bytes(experts)}")
            + f") and {fmt_bytes(available)} is available: {fix}"
        )


@dataclass
class BudgetPlan:
    budget: int
    context: int  # tokens the KV cache holds
    kv_bytes: int
    scratch_bytes: int
    trunk_total: int  # RAM the whole trunk would take
    trunk_fixed: int  # always resident: embeddings, head, norms, routers
    trunk_prefix: int  # resident decoder layers (all of them when the trunk is resident)
    trunk_layers: int
    ring_slot_bytes: int  # 0 when the trunk is resident
    trunk_bytes: int  # RAM planned for the trunk (fixed + prefix layers + ring)
    slot_bytes: int  # one expert record, page aligned
    expert_slots: int
    prefetch_slots: int
    minimum: int  # the smallest budget that runs
    overhead: int = 0  # measured interpreter RSS, outside the budget

    @property
    def trunk_resident(self) -> bool:
        return self.trunk_prefix >= self.trunk_layers

    @property
    def expert_bytes(self) -> int:
        return self.expert_slots * self.slot_bytes

    def describe(self) -> str:
        if self.trunk_resident:
            trunk = f"resident ({self.trunk_layers} layers)"
        else:
            trunk = (
                f"streamed: {self.trunk_prefix} of {self.trunk_layers} layers resident + ring of "
                f"{TRUNK_RING} x {fmt_bytes(self.ring_slot_bytes)}"
            )
        lines = [
            f"RAM budget {fmt_bytes(self.budget)} (minimum {fmt_bytes(self.minimum)}; "
            f"interpreter overhead {fmt_bytes(self.overhead)} on top):",
            f"  trunk        {fmt_bytes(self.trunk_bytes):>12}  {trunk}",
            f"  expert cache {fmt_bytes(self.expert_bytes):>12}  {self.expert_slots} slots x "
            f"{fmt_bytes(self.slot_bytes)} ({self.prefetch_slots} for prefetch)",
            f"  KV cache     {fmt_bytes(self.kv_bytes):>12}  {self.context} tokens",
            f"  scratch      {fmt_bytes(self.scratch_bytes):>12}",
        ]
        return "\n".join(lines)


def expert_slots(
    cache_bytes: int, slot_bytes: int, records: int, top_k: int, prefetch_slots: int
) -> int:
    """How many whole-record slots `cache_bytes` buys: the one sizing rule of the single-node
    plan and of a node's `--ram`. Never more than every record plus the prefetch slots (more
    would never be used); a MoeshardError below one layer's top_k plus the prefetch slots."""
    need = top_k + prefetch_slots
    slots = min(cache_bytes // slot_bytes, records + prefetch_slots)
    if slots < need:
        raise MoeshardError(
            f"{fmt_bytes(cache_bytes)} of expert cache holds {cache_bytes // slot_bytes} records "
            f"of {fmt_bytes(slot_bytes)}; need at least {need} (top-k {top_k} + "
            f"{prefetch_slots} for prefetch)"
        )
    return int(slots)


def plan_budget(
    model,  # moe.model.model_dir.ModelDir
    budget: int,
    context: int,
    prefill_tokens: int | None = None,
    prefetch: bool = True,
    layout: TrunkLayout | None = None,
    prefetch_top: int | None = None,
) -> BudgetPlan:
    """Split `budget` bytes; raises MoeshardError naming the minimum when it is too small."""
    c = model.config
    layout = layout or TrunkLayout(model.path / "trunk.gguf", model.model_id)
    kv = cache_bytes(c, context)
    scratch = scratch_bytes(c, prefill_tokens or context, context)
    slot = align_up(
        quant.expert_record_nbytes(model.expert_format, c.expert_hidden, c.expert_intermediate)
    )
    pf = (prefetch_top or c.top_k) if prefetch else 0  # a decode step predicts this many
    expert_min = (c.top_k + pf) * slot
    layers = sorted(layout.layers)
    full = layout.total_bytes()
    fixed = layout.fixed_bytes()
    ring_slot = max((layout.span(i)[1] for i in layers), default=0)
    ring = TRUNK_RING * ring_slot if len(layers) > TRUNK_RING else full - fixed
    trunk_min = min(full, fixed + ring)
    minimum = kv + scratch + trunk_min + expert_min
    if budget < minimum:
        raise MoeshardError(
            f"--ram {fmt_bytes(budget)} is below the minimum working set {fmt_bytes(minimum)} "
            f"for this model and context ({context} tokens): KV cache {fmt_bytes(kv)}, "
            f"scratch {fmt_bytes(scratch)}, trunk {fmt_bytes(trunk_min)}, "
            f"{c.top_k + pf} expert slots {fmt_bytes(expert_min)}"
        )
    left = budget - kv - scratch - expert_min
    if full <= left:
        prefix, trunk, ring_slot = len(layers), full, 0
    else:
        trunk, prefix = fixed + TRUNK_RING * ring_slot, 0
        for i in layers:  # resident prefix, in layer order
            if trunk + layout.layer_bytes(i) > left:
                break
            trunk += layout.layer_bytes(i)
            prefix += 1
    records = c.n_experts * len(c.moe_layers)
    slots = expert_slots(budget - kv - scratch - trunk, slot, records, c.top_k, pf)
    return BudgetPlan(
        budget=budget,
        context=context,
        kv_bytes=kv,
        scratch_bytes=scratch,
        trunk_total=full,
        trunk_fixed=fixed,
        trunk_prefix=prefix,
        trunk_layers=len(layers),
        ring_slot_bytes=ring_slot,
        trunk_bytes=trunk,
        slot_bytes=slot,
        expert_slots=slots,
        prefetch_slots=pf,
        minimum=minimum,
    )
