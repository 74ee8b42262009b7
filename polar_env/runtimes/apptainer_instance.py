"""One Apptainer instance per session, joined by every exec; and how a dead process's instances go.

Why: a fresh ``apptainer exec`` per tool call cost ~410 ms wall and ~88 ms host CPU here (the Go
CLI, its starter, the image mounts, every time); and a background process started in one call died
with that call's PID namespace. So ``prepare`` starts one ``apptainer instance start`` (the same
namespaces, binds, ``--containall`` and ``--network none`` as the per-exec form) and every exec
joins its namespaces with ``nsenter`` (util-linux: user, mount, pid, net, ipc, root) — what
``apptainer exec instance://`` does, without starting the Go runtime per call. Background
processes then live in the instance until the session stops, as in Docker.

Where the instance's record lives: ``APPTAINER_CONFIGDIR=<runtime root>/apptainer``, so Apptainer
writes ``instances/app/<host>/<user>/<name>/<name>.json`` (``pid``: the instance's PID 1,
``ppid``: the ``Apptainer instance: <user> [<name>]`` monitor) inside the runtime folder, never in
a user's ``~/.apptainer``. Stopping is a SIGKILL to that PID 1 (the kernel then kills the whole PID
namespace: everything the agent left running) and to the monitor, each checked against
``/proc`` first so a reused pid is never hit. ``leftovers.sweep`` calls ``stop_instances`` on every
runtime folder of a dead node process, so a crash leaves no instance behind.

The env: ``--cleanenv`` semantics by construction — nsenter's own environment is exactly the
session's (``image_env``, read once at start by sourcing the image's ``/.singularity.d/env/*.sh``
as Apptainer does, then the bundle's, spec.env and the call's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

CONFIG_DIR = "apptainer"
START_SCRIPT = "instance-start"
START_INSIDE = "/.singularity.d/actions/start"
START_TEXT = "#!/bin/sh\n# polar_env: the instance only has to stay up; execs join it\nexec sleep infinity\n"
ENV_SCRIPT = 'for f in /.singularity.d/env/*.sh; do [ -r "$f" ] && . "$f"; done; exec env -0'
NS_FLAGS = ("--user", "--mount", "--pid", "--net", "--ipc", "--root", "--wd", "--preserve-credentials")


def instance_name(root: Path) -> str:
    """Unique per runtime (its root's mkdtemp name), so a sweep can tell its instance from others."""
    return root.name.replace("_", "-")


def config_dir(root: Path) -> Path:
    return root / CONFIG_DIR


def nsenter_argv(nsenter: str, pid: int, cwd: str, command: Sequence[str]) -> list[str]:
    """Join instance ``pid``'s namespaces (its root and cwd), cd to ``cwd`` inside, exec ``command``.
    The cd is inside: nsenter's ``--wd=DIR`` would open DIR on the host."""
    return [nsenter, "-t", str(pid), *NS_FLAGS, "--", "/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "polar-cd",
            cwd, *command]


def parse_env(raw: bytes) -> dict[str, str]:
    """``env -0`` output as a dict (entries without ``=`` skipped)."""
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep and key:
            out[key] = value
    return out


class InstanceRecord(NamedTuple):
    """The fields of an Apptainer instance record this module reads."""

    name: str
    pid: int  # the instance's PID 1
    ppid: int | None  # its ``Apptainer instance: <user> [<name>]`` monitor


def records(cfg: Path) -> list[InstanceRecord]:
    """The instance records Apptainer wrote under ``cfg`` (unreadable ones skipped)."""
    found: list[InstanceRecord] = []
    for path in sorted(cfg.glob("instances/app/*/*/*/*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                ppid = data.get("ppid")
                found.append(InstanceRecord(str(data.get("name")), data["pid"], ppid if isinstance(ppid, int) else None))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def live_pids(record: InstanceRecord) -> list[int]:
    """The record's monitor and PID 1 while they are still that instance's (checked in /proc)."""
    if record.ppid is None:
        return []
    monitor = _cmdline(record.ppid)
    if not (monitor.startswith("Apptainer instance:") and f"[{record.name}]" in monitor):
        return []
    return [p for p in (record.pid, record.ppid) if p == record.ppid or _parent(p) == record.ppid]


def stop_instances(cfg: Path) -> int:
    """SIGKILL every live instance recorded under ``cfg`` (PID 1 first: its namespace dies with it);
    returns how many were live. Never raises."""
    stopped = 0
    for record in records(cfg):
        pids = live_pids(record)
        if pids:
            stopped += 1
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return stopped


def sweep_runtime(folder: Path) -> int:
    """``stop_instances`` for one runtime folder left by a dead process (``leftovers.py``)."""
    cfg = config_dir(folder)
    return stop_instances(cfg) if cfg.is_dir() else 0
