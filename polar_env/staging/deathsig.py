"""Worker processes die with the node: ``PR_SET_PDEATHSIG`` (SIGKILL) in every process the node's
forkserver pools make, and in the forkserver itself.

Why both. A forkserver child's parent is the forkserver, not the node, and the forkserver only
exits when every holder of its "alive" pipe is gone — the node *and* every worker it forked (each
inherits the pipe's write end). So a worker alone cannot notice the node's death and the
forkserver waits on the workers: after a ``kill -9`` of the node both lived on. With the death
signal on the forkserver (set by importing this module there, as a forkserver preload) and on each
worker (``run_with_deathsig`` as the pool initializer or process target), the node's death kills
the forkserver and that kills the workers, whatever signal ended the node.

The signal fires when the *thread* that forked the process exits. The forkserver is started by
the first pool, from the node's event-loop thread or one of its default executor's threads, which
live as long as the loop; a pool made after that loop ended finds the forkserver dead and
multiprocessing starts a fresh one. A forkserver started elsewhere without this preload would not
carry the signal (its workers still do, but it waits on them): make the node's pools the first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def set_deathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; exit now if it already
    has (re-parented before the call). False where prctl is missing (not Linux)."""
    parent = os.getppid()
    try:
        ok = bool(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except AttributeError:
        return False
    if ok and (parent == 1 or os.getppid() != parent):
        os._exit(1)
    return ok


def run_with_deathsig(target: Callable[..., Any], *args: Any) -> Any:
    """A worker's initializer or target: the death signal first, then ``target(*args)``."""
    set_deathsig()
    return target(*args)


def forkserver_context() -> ForkServerContext:
    """The forkserver context, with this module preloaded so the forkserver gets the death signal
    too (takes effect when the forkserver starts: the first pool of the process)."""
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, ForkServerContext)
    context.set_forkserver_preload(["__main__", __name__])  # __main__: the default preload
    return context


def _in_forkserver() -> bool:
    """Whether this import is the forkserver's preload (``multiprocessing.forkserver.main`` below us)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _in_forkserver():
    set_deathsig()
