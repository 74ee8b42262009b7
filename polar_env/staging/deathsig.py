"""Worker processes die with the node: ``PR_SET_PDEATHSIG`` (SIGKILL) in every process the node's
forkserver pools make, and in the forkserver itself.

Why both. A forkserver child's parent is the forkserver, not the node, and the forkserver only
exits when every holder of its "alive" pipe is gone — the node *and* every worker it forked (each
inherits the pipe's write end). So a worker alone cannot notice the node's death and the
forkserver waits on the workers: after a ``kill -9`` of the node both lived on. With the death
signal on the forkserver (set by importing this module there, as a forkserver preload) and on each
worker (``run_with_deathsig`` as the pool initializer or process target), the node's death kills
the forkserver and that kills the workers, whatever signal ended the node.

The signal fires when the *thread* that forked the process exits. The node's pools launch the
forkserver from the event-loop thread (``launch_forkserver``), which lives as long as the loop, and
start their workers from helper threads (a start waits on the forkserver); a pool made after that
loop ended finds the forkserver dead and multiprocessing starts a fresh one. A forkserver started elsewhere without this preload would not
carry the signal (its workers still do, but it waits on them): make the node's pools the first.

Start-up cost. The forkserver preloads the workers' modules (``WORKER_MODULES``) once, so a worker
is a cheap fork, which lowers its own priority (``lower_priority``) before its work. Without that
each worker imported polar_env itself at the gateway's priority: ``spawn.prepare`` re-imports the
node's ``__main__`` in every child (the forkserver's ``__main__`` preload is a no-op on CPython 3.11:
it is never handed a ``main_path``), ~1-2 s of CPU a worker, eight of them at the start of a run on
two cores (bench_staging.py: staged/sequential 1.86x → 1.28x). With the node's modules already in
the forkserver, that re-import finds them loaded. The forkserver's own preload keeps the node's
priority: niced, a busy machine's other processes starved it for tens of seconds, and every
session's POSTRUN waited on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

PR_SET_PDEATHSIG = 1
WORKER_NICE = 10  # worker processes do throughput work; the gateway's replies win the shared cores
# What the node's workers run (POSTRUN builds, evaluations) and what a node's __main__ imports:
# loaded once in the forkserver, inherited by every worker it forks.
WORKER_MODULES = ["polar_env.staging.postrun_pool", "polar_env.staging.eval_worker", "polar_env.staging.node",
                  "polar_env.staging.server"]
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


def lower_priority() -> None:
    """A worker's first step: ``WORKER_NICE`` below the node's priority (it forked from the
    forkserver, which runs at the node's)."""
    try:
        os.nice(WORKER_NICE)
    except OSError:  # not permitted here: run at the node's priority
        pass


def forkserver_context() -> ForkServerContext:
    """The forkserver context, with this module preloaded first (the forkserver gets the death
    signal too) and then the workers' modules (takes effect when the forkserver starts: the first
    pool of the process)."""
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, ForkServerContext)
    context.set_forkserver_preload(["__main__", __name__, *WORKER_MODULES])  # __main__: the default preload
    return context


def launch_forkserver() -> ForkServerContext:
    """``forkserver_context`` with its forkserver launched now, from this thread (a fork and an
    exec, ~2 ms; the preload runs in the new process): call it on the node's event-loop thread,
    which lives as long as the node, before a pool starts workers from a helper thread."""
    context = forkserver_context()
    multiprocessing.forkserver.ensure_running()
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
