"""Threads of lower CPU priority, for the node's bulk work (large Forwards parsed, computed
and serialized there): on a busy node the threads that receive, check and answer other
clients' small requests go first."""

from __future__ import annotations

import os
import threading


def lower_priority(nice: int) -> None:
    """Run the calling thread (Linux: a thread has a policy and nice value of its own) under
    SCHED_IDLE: any other thread of the machine that wakes takes the core from it at once.
    Under a nice value alone (the fallback) the kernel's EEVDF scheduler lets a running thread
    finish its slice before a woken one runs, milliseconds per small request."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (0: this thread)
        return
    except (OSError, AttributeError):  # not Linux
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):  # not allowed: same priority, still fair
        pass
