"""The table of `moeshard bench compare-llamacpp`: per-round values on both sides, the
medians, ranges and ratios printed, and the goals the ratios are judged against. Pure
functions (tests/test_compare_llamacpp.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Row:
    """One line of the table: per-round values of both tools (None: that run failed)."""

    key: str
    name: str
    moeshard: list[float | None] = field(default_factory=list)
    llama: list[float | None] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # why llama.cpp runs gave no value

    def ratios(self) -> list[float]:
        """moeshard / llama.cpp of each round where both ran."""
        return [m / w for m, w in zip(self.moeshard, self.llama, strict=True) if m and w]


def fmt_value(v: float) -> str:
    """Three significant figures, no exponent: 16431 -> '16431', 436.2 -> '436', 6.27 -> '6.27'."""
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def spread(values: Sequence[float], fmt=fmt_value) -> str:
    """'median [min-max]' ('median' alone for one value)."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} [{fmt(min(values))}-{fmt(max(values))}]"


def cell(values: Sequence[float | None], failures: Sequence[str] = ()) -> str:
    """A table cell: the spread of the runs that gave a value, then what became of the others
    ('OOM-killed 3/3')."""
    got = [v for v in values if v is not None]
    text = spread(got) if got else ""
    counts = {reason: failures.count(reason) for reason in dict.fromkeys(failures)}
    notes = ", ".join(f"{reason} {n}/{len(values)}" for reason, n in counts.items())
    return f"{text} ({notes})" if text and notes else (text or notes or "-")


def ratio_cell(row: Row) -> str:
    ratios = row.ratios()
    return spread(ratios, lambda r: f"{r:.2f}") if ratios else "-"


def table(rows: Sequence[Row], against: str = "llama.cpp") -> list[str]:
    """The table's lines: name | moeshard | llama.cpp | moeshard/llama.cpp (`against` names
    the right-hand side: the bandwidth rows compare with the DRAM read rate)."""
    head = ("", "moeshard", against, f"moeshard/{against}")
    body = [(r.name, cell(r.moeshard), cell(r.llama, r.failures), ratio_cell(r)) for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(4)]
    lines = []
    for n, line in enumerate([head, *body]):
        lines.append(
            "  ".join(
                text.ljust(w) if i == 0 else text.rjust(w)
                for i, (text, w) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            lines.append("-" * len(lines[0]))
    return lines


@dataclass(frozen=True)
class Goal:
    """A "Must show" line of issue 17: the median per-round ratio of a row, at least `minimum`."""

    key: str  # the row's key
    label: str
    minimum: float
    moonshot: float | None = None


GOALS = [
    Goal("kernel q4_0 1", "kernels q4_0 1 col", 1.0),
    Goal("kernel q8_0 1", "kernels q8_0 1 col", 1.0),
    Goal("kernel q4_0 4", "kernels q4_0 4 cols", 1.0),
    Goal("kernel q8_0 4", "kernels q8_0 4 cols", 1.0),
    # issue 38: at llama.cpp's level on the same formats at each ISA level (was 0.67 / 0.5 /
    # 1/3, issue 17's)
    Goal("big decode same", "big model decode, same formats", 1.0),
    Goal("big prefill same", "big model prefill, same formats", 1.0),
    Goal("demo decode same", "demo model decode", 0.6),
    Goal("demo prefill same", "demo model prefill", 1.0),
    Goal("bandwidth bf16 trunk", "bf16 trunk at batch 1, share of DRAM read", 0.8),
    Goal("bandwidth q4_0 experts", "q4_0 experts at batch 1, share of DRAM read", 0.8),
    Goal("capped mmap", "memory-capped decode vs llama.cpp with mmap", 3.0),
]


def relative_goal_line(row: Row, baseline: Row | None) -> str:
    """Issue 39: the Q4_K_M file's decode ratio at least the same-format q4_0 model's."""
    label = "big model decode, Q4_K_M experts, same file on both sides"
    mine = row.ratios()
    if not mine:
        return f"{label}: not measured"
    ratio = statistics.median(mine)
    if baseline is None or not baseline.ratios():
        return f"{label}: ratio {ratio:.2f} (goal >= the q4_0 row's, not measured in this run)"
    base = statistics.median(baseline.ratios())
    verdict = "MET" if ratio >= base else "NOT MET"
    return f"{label}: ratio {ratio:.2f} (goal >= same-format q4_0's {base:.2f}): {verdict}"


def goal_line(goal: Goal, row: Row | None) -> str:
    """'kernels q4_0 1 col: ratio 0.83 (goal >= 1.0): NOT MET'. A llama.cpp that never ran
    (killed under the memory cap) while moeshard did meets the goal."""
    want = f"goal >= {goal.minimum:.2g}" + (
        f", moonshot {goal.moonshot:.2g}" if goal.moonshot else ""
    )
    if row is None:
        return f"{goal.label}: not measured in this run ({want})"
    ratios = row.ratios()
    if not ratios:
        ran = any(v is not None for v in row.moeshard)
        if ran and row.failures and all(v is None for v in row.llama):
            return f"{goal.label}: llama.cpp {row.failures[0]}, moeshard ran ({want}): MET"
        return f"{goal.label}: no ratio, a side failed ({want}): NOT MET"
    ratio = statistics.median(ratios)
    verdict = "MET" if ratio >= goal.minimum else "NOT MET"
    if goal.moonshot and ratio >= goal.moonshot:
        verdict += " (moonshot too)"
    return f"{goal.label}: ratio {ratio:.2f} ({want}): {verdict}"
