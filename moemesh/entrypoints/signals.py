"""Commands that write files or start processes end on SIGTERM and SIGHUP as they do on Ctrl-C."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def stop_on_hangup():
    """SIGTERM and SIGHUP end the command as Ctrl-C does, by an exception (SystemExit, with the status
    their default action gives), so that every `finally` and cleanup runs (eval-demo's server and
    lm-eval stopped, a half-written checkpoint taken back): the default action ended this process
    alone, there and then. A signal ignored (nohup) stays ignored."""
    signals = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) != signal.SIG_IGN]
    if threading.current_thread() is not threading.main_thread():  # (only the main thread handles signals)
        signals = []
    before = {sig: signal.getsignal(sig) for sig in signals}

    def handler(signum, frame):
        for sig in signals:  # (once: a second signal must not cut the cleanup short)
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
