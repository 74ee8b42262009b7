"""Machine-wide test resources shared by the pytest-xdist workers (the private dockerd, the
debootstrap rootfs): one worker at a time builds or starts each, and a daemon the tests started is
stopped by the last worker still using it, not by the first to finish. A lock and a registry of
live users make this hold whichever tests land in which worker, so no test has to be grouped by hand."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

LOCK_DIR = Path(os.environ.get("POLAR_TEST_LOCKS", "/tmp/polar-test-locks"))


@contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Held by one process at a time (flock; the kernel drops it if the holder dies)."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DaemonUsers:
    """Who uses a daemon under ``state_dir``; start it and ``join``, or ``leave``, under ``lock()``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.users = state_dir / "test-users"
        self.marker = state_dir / "started-by-tests"  # absent: someone else's daemon, never stopped

    def lock(self) -> AbstractContextManager[None]:
        """This daemon's machine_lock (one per state dir)."""
        return machine_lock("daemon" + str(self.state_dir).replace("/", "_"))

    def join(self, started: bool) -> None:
        self.users.mkdir(parents=True, exist_ok=True)
        if started:
            self.marker.touch()
        (self.users / str(os.getpid())).touch()

    def leave(self) -> bool:
        """True when the caller was the last live user of a daemon the tests started: stop it."""
        (self.users / str(os.getpid())).unlink(missing_ok=True)
        live = False
        for entry in self.users.iterdir() if self.users.is_dir() else ():
            if entry.name.isdigit() and _alive(int(entry.name)):
                live = True
            else:
                entry.unlink(missing_ok=True)  # a worker that died without leaving
        if live or not self.marker.exists():
            return False
        self.marker.unlink()
        return True
