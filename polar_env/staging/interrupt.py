"""SIGINT / SIGTERM for a running job: the first asks it to stop cleanly, the second exits at once.

The first signal sets ``stop`` (the job stops starting sessions, or cancels its start-up, cancels the
running ones, finishes POSTRUN for what was captured and writes every output) and starts the
process's shutdown deadline (``deadline.py``: every close step shares it, then what is left is
killed); a second one exits the process immediately (128 + signal number), leaving the captures on
disk for ``--resume``. Handlers are installed on the
running loop only in the main thread, and never over a signal the parent chose to ignore (a
background job of a non-interactive shell ignores SIGINT by convention).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from types import TracebackType
from typing import Any

from polar_env.observe.liveness import end_all
from polar_env.staging import deadline


class StopSignals:
    def __init__(self, what: str = "the run") -> None:
        self.what = what
        self.stop = asyncio.Event()
        self.signal_name: str | None = None
        self._installed: list[tuple[signal.Signals, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def fired(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process stopped by it."""
        return 128 + int(getattr(signal, self.signal_name or "SIGINT"))

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue
            try:
                self._loop.add_signal_handler(sig, self._fire, sig)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
                continue
            self._installed.append((sig, previous))
        return self

    def _fire(self, sig: signal.Signals) -> None:
        assert self._loop is not None
        self.signal_name = sig.name
        deadline.begin(deadline.SIGNAL_BUDGET_S)  # every close step from here on shares it (deadline.py)
        deadline.arm_watchdog(self.exit_code)  # and the polar-env process exits by HARD_LIMIT_S whatever
        self.stop.set()
        for installed, _ in self._installed:  # from now on a signal exits even while the loop is busy
            self._loop.remove_signal_handler(installed)
            signal.signal(installed, _exit_now)
        print(f"\npolar-env: {sig.name}: stopping {self.what}: no new sessions, cancelling the running ones and "
              f"finishing POSTRUN for what they captured ({sig.name} again exits at once)", file=sys.stderr, flush=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._loop is not None
        for sig, previous in self._installed:
            self._loop.remove_signal_handler(sig)  # False when _fire already took it over
            signal.signal(sig, previous)
        self._installed.clear()
        if self.fired:
            deadline.reset()  # the next job in this process starts clean


def _exit_now(signum: int, frame: Any) -> None:
    print(f"\npolar-env: second {signal.Signals(signum).name}: exiting now; the captures stay on disk for --resume",
          file=sys.stderr, flush=True)
    name = signal.Signals(signum).name
    end_all("interrupted", signal=name, error=f"a second {name}: exited at once, without writing the run's outputs")
    if deadline.whole_process():  # nothing of the run left behind (sandboxes, workers, harness CLIs)
        deadline.kill_descendants()
    os._exit(128 + signum)


async def until_signal() -> None:
    """Wait for SIGINT or SIGTERM: a server's whole life (``serve`` and the gateway commands), which
    then shuts down in its ``finally``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
