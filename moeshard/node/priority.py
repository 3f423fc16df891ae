"""Threads of lower CPU priority, for the node's bulk work (large Forwards parsed, computed
and serialized there): on a busy node the threads that receive, check and answer other
clients' small requests go first.

Lower, never idle: a bulk thread holds what the other threads need (the interpreter's lock
while it runs Python, the compute turn while it computes a chunk). Under SCHED_IDLE it got no
CPU at all while any other thread of the machine could run, and kept holding them: with two
busy processes beside the node on 2 cores, one 30,840-row Forward took 87 s instead of 0.3 s
(2 s at nice +10), and an honest client's call waiting behind it missed its 5 s deadline
(docs/security.md, "The bulk threads' priority"). A nice value keeps the thread a bounded
share of a core (about 10% against one busy thread at nice +10), so what it holds is given
back within a few of its slices."""

from __future__ import annotations

import os
import threading

MAX_NICE = 19  # the lowest priority a nice value gives


def lower_priority(nice: int) -> None:
    """Run the calling thread at `nice` above its present nice value, at most MAX_NICE (Linux:
    a thread has a nice value of its own, set through its thread id; relative, so a node
    started under `nice -n 15` does not raise its bulk threads to 10); where that is refused,
    or not Linux, the thread keeps its priority, which is still fair."""
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + nice))
    except (OSError, AttributeError):  # not allowed: same priority, still fair
        pass
