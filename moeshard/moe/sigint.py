"""SIGINT as the process got it: a background job of a shell without job control (`cmd &` in
a script, `nohup`) starts with SIGINT ignored, so that a Ctrl-C meant for the foreground
stops the script and not the job. Python keeps that (it installs no KeyboardInterrupt
handler then), and so do moeshard's own handlers: `install` leaves an ignored SIGINT
ignored. SIGTERM still stops such a process as it stops any other.

The console script imports this module before it sets any handler (`moeshard.entry`), so
`IGNORED` is the disposition the process inherited."""

import contextlib
import signal
import threading

IGNORED = signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def install(handler):
    """`signal.signal(SIGINT, handler)`, unless SIGINT came ignored: then nothing changes.
    Returns the handler in place before (to put back: SIG_IGN stays SIG_IGN)."""
    if IGNORED:
        return signal.SIG_IGN
    return signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def held(act_after: bool = False):
    """Within the block a SIGINT sets the yielded event instead of acting; the handler before
    is back at its end (main thread only, as every signal handler).  With `act_after`, a
    SIGINT held is then handed to that handler, as if it had come just after the block."""
    got = threading.Event()
    previous = install(lambda signum, frame: got.set())
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, previous)
    if act_after and got.is_set() and callable(previous):
        previous(signal.SIGINT, None)
