"""Test hosts that share no disk: network namespaces on a bridge, each with its own address, its
own copy of chosen folders and its own /dev/shm and temp dir, made by the test and removed after.

A host is a network namespace joined to the head's bridge by a veth pair (10.213.N.0/24: traffic
stays between these hosts and loopback), processes started in a private mount namespace where each
``private`` folder is bind-mounted from the host's own disk (``<root>/<host>/disk/...``), and a v1
freezer cgroup holding every process it starts: ``power_off`` freezes the cgroup and kills what is in
it, as a host that loses power (nothing gets to clean up). Needs root, ``ip``, ``unshare`` and the
freezer controller; ``unavailable`` names what is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FREEZER = Path("/sys/fs/cgroup/freezer")


def missing() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, bind mounts, cgroups)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (apt-get install -y iproute2 util-linux)"
    if not (FREEZER / "cgroup.procs").exists():
        return "the cgroup v1 freezer controller is not mounted at /sys/fs/cgroup/freezer"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    disk: Path  # what this host's private folders are, seen from outside
    cgroup: Path
    private: tuple[Path, ...] = ()  # folders this host sees from its own disk instead of the shared one
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host (its network, its mounts, its cgroup); output to ``log``."""
        binds = []
        for folder in self.private:
            own = self.disk / folder.relative_to("/")
            own.mkdir(parents=True, exist_ok=True)
            folder.mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {own} {folder}")
        script = " && ".join([*binds, "mount -t tmpfs -o size=4g tmpfs /dev/shm", 'exec "$@"'])
        tmp = self.disk / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        procs = self.cgroup / "cgroup.procs"

        def join_cgroup() -> None:
            procs.write_text(str(os.getpid()))

        out = log.open("ab")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private", "--",
             "sh", "-c", script, "sh", *argv],
            env={**env, "TMPDIR": str(tmp)}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=join_cgroup)
        out.close()
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: dict[str, str], log: Path, timeout_s: float = 120) -> None:
        proc = self.popen(argv, env, log)
        if proc.wait(timeout_s) != 0:
            raise RuntimeError(f"{' '.join(argv)} failed on {self.name} (rc {proc.returncode}); see {log}")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def power_off(self, timeout_s: float = 30) -> None:
        """Every process of this host stops at once (frozen, then killed); returns when none is left."""
        state = self.cgroup / "freezer.state"
        with contextlib.suppress(OSError):
            state.write_text("FROZEN")
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                state.write_text("THAWED")  # killed tasks exit only once thawed
            time.sleep(0.1)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self.pids():
            raise RuntimeError(f"host {self.name}: processes {self.pids()} survived power-off")


@contextlib.contextmanager
def hosts(root: Path, workers: int, private: Sequence[Path] = ()) -> Iterator[list[Host]]:
    """A head (index 0, on the shared filesystem) and ``workers`` hosts whose ``private`` folders
    are their own; all removed (processes killed, namespaces and cgroups deleted) on exit."""
    tag = secrets.token_hex(2)
    subnet = f"10.213.{int(tag, 16) % 250 + 1}"
    made: list[Host] = []
    try:
        for i in range(workers + 1):
            name = "head" if i == 0 else f"w{i}"
            ns = f"polar-{tag}-{name}"
            cgroup = FREEZER / f"polar-host-{tag}-{name}"
            cgroup.mkdir()
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
            host = Host(name, ns, f"{subnet}.{i + 1}", root / name, cgroup, tuple(private) if i else ())
            made.append(host)
            _ip("link", "set", "lo", "up", ns=ns)
            if i == 0:
                _ip("link", "add", "br0", "type", "bridge", ns=ns)
                _ip("addr", "add", f"{host.ip}/24", "dev", "br0", ns=ns)
                _ip("link", "set", "br0", "up", ns=ns)
                continue
            outer, inner = f"p{tag}h{i}", f"p{tag}w{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", made[0].ns)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", "br0", "up", ns=made[0].ns)
            _ip("addr", "add", f"{host.ip}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
        yield made
    finally:
        for host in reversed(made):
            with contextlib.suppress(RuntimeError):
                host.power_off()
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=30)
            with contextlib.suppress(OSError):
                host.cgroup.rmdir()
