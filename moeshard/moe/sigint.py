"""SIGINT as the process got it: a background job of a shell without job control (`cmd &` in
a script, `nohup`) starts with SIGINT ignored, so that a Ctrl-C meant for the foreground
stops the script and not the job. Python keeps that (it installs no KeyboardInterrupt
handler then), and so do moeshard's own handlers: `install` leaves an ignored SIGINT
ignored. SIGTERM still stops such a process as it stops any other.

The console script imports this module before it sets any handler (`moeshard.entry`), so
`IGNORED` is the disposition the process inherited."""

import signal

IGNORED = signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def install(handler):
    """`signal.signal(SIGINT, handler)`, unless SIGINT came ignored: then nothing changes.
    Returns the handler in place before (to put back: SIG_IGN stays SIG_IGN)."""
    if IGNORED:
        return signal.SIG_IGN
    return signal.signal(signal.SIGINT, handler)
