"""One long-lived bubblewrap sandbox per session, joined by every exec.

Why: with a fresh ``bwrap --unshare-all`` per tool call, a background process (``cmd &``, a server
the agent starts for its tests) died with that call's PID namespace, while on Docker and Apptainer it
lives until the session stops. So the session's first exec starts one *instance*: ``bwrap`` with the
session's own user, pid, net, ipc, uts and cgroup namespaces (the same mounts as an exec) running a
holder, ``/bin/sh -c 'echo polar-ready; read -r _'`` on a pipe whose write end only this process holds. Each exec
then joins it:

    nsenter --user=FD --net=FD --ipc=FD --uts=FD --cgroup=FD --preserve-credentials -- \\
        bwrap --pidns FD <the same mounts> --die-with-parent --cap-drop ALL -- CMD

nsenter enters the user namespace first (so the unprivileged caller may join the rest); ``bwrap
--pidns`` puts CMD in the session's PID namespace and mounts that namespace's ``/proc`` (a bare
``nsenter --pid`` would leave bwrap reading the host's ``/proc`` with the session's pid numbers);
``--cap-drop ALL`` leaves CMD no capability inside, as before. No ``--new-session``: CMD stays in
the exec's process group (the caller already has no terminal), so a timeout kills the command and
what it started in that group, and what it detached (``setsid``, daemons) lives on, as under
Docker's ``timeout -s KILL``.

The namespaces are held as file descriptors opened once from ``/proc/<pid>/ns`` and checked
against the inode numbers bwrap reports on ``--info-fd``, so a reused pid can never make an exec
join another process's namespaces. Lifetime is a mechanism, not a sweep: when the holder's pipe
closes (``stop``, or this process dying for any reason) the holder exits, the instance's PID 1
exits, and the kernel kills everything left in its PID namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field

JOINED = ("user", "net", "ipc", "uts", "cgroup")  # nsenter's; the pid namespace is bwrap's (--pidns)
READY = b"polar-ready\n"
# says it is up (bwrap has then written the uid map, mounted and dropped capabilities: --info-fd comes
# before that, and an exec joining a user namespace with no uid map yet is refused by bwrap), then
# exits when the pipe's write end closes
HOLDER = ("/bin/sh", "-c", "echo polar-ready; read -r _ || :")
INFO_TIMEOUT_S = 60.0
INFO_KEYS = {"net": "net-namespace", "ipc": "ipc-namespace", "uts": "uts-namespace", "pid": "pid-namespace",
             "cgroup": "cgroup-namespace"}


@dataclass(slots=True)
class Instance:
    """A started instance: its bwrap process, the holder pipe's write end and its namespaces' fds."""

    proc: asyncio.subprocess.Process
    hold: int
    fds: dict[str, int] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return tuple(self.fds.values())

    def close(self) -> None:
        """Close the holder pipe (the instance then ends) and the namespace fds. Idempotent."""
        for fd in [self.hold, *self.fds.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.hold = -1
        self.fds = {}


def nsenter_argv(nsenter: str, instance: Instance) -> list[str]:
    """Join the instance's namespaces but its pid and mount ones (bwrap builds those)."""
    return [nsenter, *(f"--{ns}=/proc/self/fd/{instance.fds[ns]}" for ns in JOINED), "--preserve-credentials", "--"]


async def read_info(fd: int, timeout_s: float = INFO_TIMEOUT_S) -> dict[str, int] | None:
    """bwrap's ``--info-fd`` JSON from the read end ``fd`` (closed here); None when bwrap ended first."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"}"), timeout_s)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
        return None
    finally:
        transport.close()
    data = json.loads(raw)
    return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else None


def open_namespaces(info: dict[str, int]) -> dict[str, int]:
    """fds on the instance's namespaces, each checked against the inode bwrap reported (the user
    namespace, which bwrap does not report, against its pid namespace's owner: the same process)."""
    pid = info["child-pid"]
    fds: dict[str, int] = {}
    try:
        for ns in (*JOINED, "pid"):
            fds[ns] = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        for ns, key in INFO_KEYS.items():
            if key in info and os.fstat(fds[ns]).st_ino != info[key]:
                raise ProcessLookupError(f"pid {pid} is no longer the sandbox's ({ns} namespace differs)")
        if os.stat(f"/proc/{pid}/ns/pid").st_ino != os.fstat(fds["pid"]).st_ino:
            raise ProcessLookupError(f"pid {pid} is no longer the sandbox's")
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds
