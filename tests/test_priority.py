"""The node's bulk threads run at a lower priority, relative to their own (node.priority)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from moeshard.node.priority import MAX_NICE, lower_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice_after(start: int, step: int) -> int:
    """The nice value of a new thread set to `start`, after lower_priority(step)."""
    seen = []

    def run():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start)  # (raising one's nice needs no privilege)
        lower_priority(step)
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_lowered_relative_to_the_threads_own_value():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    start = max(base, 2)
    assert _nice_after(start, 10) == min(MAX_NICE, start + 10)
    # a node started under `nice -n 15`: its bulk threads go lower still, never back up
    assert _nice_after(max(base, 15), 10) == MAX_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # (this thread)
