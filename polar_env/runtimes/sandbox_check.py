"""The bubblewrap sandbox's preflight check (its ``RUNTIMES`` entry's ``preflight``): bwrap is on
PATH and can create the namespaces every sandbox exec asks for; as root, the unprivileged uids the
execs drop to can reach the runtime folders; the sessions' images are in the store."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.runtimes import hostworkspace  # its drops_privileges read at each call (tests stand in for root)
from polar_env.runtimes.base import RuntimeNeeds
from polar_env.runtimes.imagestore import missing_local
from polar_env.runtimes.reach import TRAVERSE_FIX, blocking_dir, default_base, describe, stage_parent, stage_parents
from polar_env.runtimes.sandbox import BWRAP_INSTALL

BWRAP_PROBE_TIMEOUT_S = 5.0


def check_sandbox(needs: RuntimeNeeds) -> None:
    check_bwrap()
    check_runtime_base()
    if (missing := missing_local(needs.images, "sandbox")) is not None:
        raise ConfigError(missing)


def check_bwrap() -> None:
    """bwrap runs ``true`` with the namespaces every sandbox exec asks for (sandbox.py bwrap_argv)."""
    bwrap = shutil.which(os.environ.get("POLAR_BWRAP") or "bwrap")
    if bwrap is None:
        raise ConfigError(f"bubblewrap (bwrap) is not on PATH, runtime sandbox; {BWRAP_INSTALL}, or use --runtime docker")
    true = shutil.which("true") or "/bin/true"
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--uid", "0", "--gid", "0", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", true]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BWRAP_PROBE_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"bwrap did not run ({exc}), runtime sandbox; check {bwrap}") from None
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ConfigError(f"bwrap cannot create its namespaces ({why}), runtime sandbox; allow unprivileged user "
                          "namespaces (sysctl kernel.unprivileged_userns_clone=1; in a container: --privileged or a "
                          "seccomp profile that permits clone/unshare), or use --runtime docker")


def check_runtime_base(base: Path | None = None) -> None:
    """As root, sandbox execs drop to unprivileged uids: they must reach the runtime base (default
    ``$TMPDIR/polar-runtimes``) or a stage parent every uid can traverse (reach.py)."""
    if not hostworkspace.drops_privileges():
        return
    base = base if base is not None else default_base()
    blocked = blocking_dir(base, hostworkspace.SANDBOX_UID_BASE)
    if blocked is None or stage_parent() is not None:
        return
    raise ConfigError(f"the sandbox's unprivileged uids cannot traverse {describe(blocked)} to the runtime folder {base}, "
                      f"and none of {', '.join(map(str, stage_parents()))} is a writable dir every user can traverse (for a stage), "
                      f"runtime sandbox; {TRAVERSE_FIX}, or chmod o+x {blocked}")
