"""Measure the per-session limits on this machine through real sandboxed sessions: peak RSS of the
rollout process under an output flood, how a fork storm, a memory hog and every known way round the
disk bound end (big file, file deleted while held open, 100,000 empty directories, a 3,000-level
tree, /tmp and HOME fills), a 3,000-level tree removed at teardown, and a rollout started right
after one that left such a tree was killed (SIGKILL, SIGTERM, SIGINT); orphaned processes counted.

    python scripts/limits_probe.py [--only flood] [--flood-bytes N] [--no-kill]

Every rollout runs in a child process with a private ``TMPDIR`` (its runtime folders, stage dirs
and sockets live there), so leftovers and orphans (any process still carrying that ``TMPDIR``) are
this probe's own. Run it on another checkout (``PYTHONPATH=<old checkout>:<this checkout>``) for a
baseline (the ``--only flood`` case is the one safe to run without limits)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

SMALL = {"pids_limit": 64, "memory_mb": 256, "disk_mb": 64}
DEEP = 3000


def _py(code: str) -> str:
    return "python3 -c " + shlex.quote(code)


HELD_OPEN = _py("import os, time\nf = open('/testbed/held', 'wb'); n = 0\ntry:\n"
                "    while n < 200 * 2**20: f.write(b'x' * 2**20); f.flush(); n += 2**20\n"
                "except OSError as e: print('refused:', e)\n"
                "os.unlink('/testbed/held'); print('held open, unlinked:', n >> 20, 'MiB'); time.sleep(20)")
MANY_DIRS = _py("import os\ni = 0\ntry:\n    while i < 100000: os.mkdir(f'/testbed/m{i}'); i += 1\n"
                "except OSError as e: print('refused:', e)\nprint('dirs made:', i)")
DEEP_FILL = _py(f"import os\nos.chdir('/testbed')\nfor i in range({DEEP}): os.mkdir('d'); os.chdir('d')\n"
                "n = 0\ntry:\n    with open('big', 'wb') as f:\n"
                "        while n < 200 * 2**20: f.write(b'x' * 2**20); f.flush(); n += 2**20\n"
                "except OSError as e: print('refused:', e)\nprint('written at depth 3000:', n >> 20, 'MiB')")
DEEP_ONLY = _py(f"import os\nos.chdir('/testbed')\nfor i in range({DEEP}):\n    os.mkdir('d'); os.chdir('d')\n"
                "    if i % 1000 == 999: os.chmod('..', 0o500)\n"
                "open('/testbed/.deep-done', 'w').close(); print('deep tree made')")


def cases(flood_bytes: int) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "flood": (f"head -c {flood_bytes} /dev/zero | tr '\\0' a; echo flood-done", {}),
        "forks": ("for i in $(seq 2000); do sleep 30 & done; wait", SMALL),
        "memory": ("python3 -c \"x = b'a' * (1 << 30); print(len(x))\"", SMALL),
        "big_file": ("for i in 1 2 3 4 5; do head -c 30000000 /dev/zero > /testbed/f$i; done; sleep 12; echo filled", SMALL),
        "held_open": (HELD_OPEN, SMALL),
        "many_dirs": (MANY_DIRS, SMALL),
        "deep_fill": (DEEP_FILL, SMALL),
        "tmp_fill": ("head -c 200000000 /dev/zero > /tmp/fill; echo exit $?; sleep 5", SMALL),
        "home_fill": ("head -c 200000000 /dev/zero > $HOME/fill; echo exit $?; sleep 5", SMALL),
        "deep_teardown": (DEEP_ONLY, SMALL),
        "shadow": ("cat /etc/shadow | head -c 40; echo; id -u; cat /proc/self/uid_map", {}),
        "normal": ("echo 6*7=$((6*7))", SMALL),
    }


_CHILD = """
import json, sys
from pathlib import Path
from tests.evaluators.attacks import run_sessions

def peak_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

tmp, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
results = run_sessions(tmp, {name: (cmd, rt) for name, (cmd, rt) in cases.items()})
print(json.dumps({"peak_mb": peak_mb(), "results": {k: v.model_dump(mode="json", exclude={"trajectory"})
                                                     for k, v in results.items()}}))
"""


def _child(tmpdir: Path, store: Path, run: dict[str, tuple[str, dict[str, Any]]]) -> subprocess.Popen[str]:
    path = [p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p]  # a baseline checkout first
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(store), json.dumps(run)], cwd=tmpdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's results, or ``{"failed": <exit code and last error line>}``."""
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0 or not out.strip():
        last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["?"]
        return {"failed": f"exit {proc.returncode}: {last[0][:200]}"}
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def orphans(tmpdir: Path) -> list[int]:
    """Live processes (not zombies) that still carry the probe's private TMPDIR."""
    mark = f"TMPDIR={tmpdir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def wait_orphans(tmpdir: Path, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := orphans(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def runtime_folders(tmpdir: Path) -> list[str]:
    base = tmpdir / "polar-runtimes"
    return sorted(str(p) for p in base.glob("*/*/polar-*")) if base.is_dir() else []


def mounts(tmpdir: Path) -> list[str]:
    """Mount points under ``tmpdir`` (read here: a baseline checkout has no diskfs)."""
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(f"{tmpdir}/")]


def row(name: str, r: dict[str, Any]) -> str:
    limits = r.get("limits") or {}
    hit, mech = "-", "-"
    if limits.get("hit"):  # "<limit>=<value> (<mechanism>): <why>"
        head, _, hit = limits["hit"].partition("): ")
        mech = head.split(" (", 1)[-1]
    failure = r["failure_kind"] or "-"
    if failure not in ("-", "limit_exceeded"):
        failure += f" ({(r.get('failure_detail') or '')[:160]})"
    return f"| {name} | {r['status']} | {r['reward']:.1f} | {failure} | {hit} | {mech} |"


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, cmdline) of every live process (zombies left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry)] = (int(fields[1]), cmd)
    return out


def descendants(pid: int) -> dict[int, str]:
    procs, found, todo = _procs(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, cmd) in procs.items():
            if ppid == parent and child not in found:
                found[child] = cmd
                todo.append(child)
    return found


def survivors(pids: dict[int, str], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if p in _procs()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_phase(work: Path, sig: signal.Signals) -> str:
    """A rollout holding a 3,000-level tree in a live session (and, from a finished one, its POSTRUN
    forkserver and workers) is killed with ``sig``; a rollout started right after must sweep it and
    complete, and none of the victim's processes may outlive it."""
    tmpdir = work / f"k{int(sig)}"
    tmpdir.mkdir()
    victim = _child(tmpdir, work / f"store-k{int(sig)}",
                    {"normal": ("echo 6*7=$((6*7))", SMALL), "deep_sleep": (DEEP_ONLY + "; sleep 300", SMALL)})
    deadline = time.monotonic() + 180
    while not (list((tmpdir / "polar-runtimes").glob("*/*/polar-*/workspace/.deep-done"))
               and any("forkserver" in c for c in descendants(victim.pid).values())):
        if time.monotonic() > deadline or victim.poll() is not None:
            victim.kill()
            raise SystemExit(f"{sig.name}: the victim rollout never got there: {victim.communicate()[1][-2000:]}")
        time.sleep(0.2)
    time.sleep(1.0)  # the finished session's POSTRUN workers are up
    held = runtime_folders(tmpdir)
    tree = descendants(victim.pid)
    kinds = sorted({"forkserver" if "forkserver" in c else "mp workers/tracker" if "multiprocessing" in c else
                    "bwrap/sandbox" for c in tree.values()})
    victim.send_signal(sig)
    victim.wait(timeout=120)  # not communicate(): an orphan would hold its pipes open
    for pipe in (victim.stdout, victim.stderr):
        if pipe is not None:
            pipe.close()
    left = survivors(tree)
    after_death = [p for p in held if Path(p).exists()]
    started = time.monotonic()
    after = _finish(_child(tmpdir, work / f"store-n{int(sig)}", {"normal": ("echo 6*7=$((6*7))", SMALL)}))
    if "failed" in after:
        nxt = f"FAILED {after['failed']}"
    else:
        nxt = f"{after['results']['normal']['status']} {after['results']['normal']['reward']:.1f}"
    still = [p for p in held if Path(p).exists()]
    at_end = orphans(tmpdir)
    for pid in [*left, *at_end]:  # a baseline's orphans: this probe's own, ended by pid
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return (f"| {sig.name} | exit {victim.returncode} | {len(tree)} ({', '.join(kinds)}) | {len(left)} | "
            f"{len(held)} / {len(after_death)} | {nxt} ({time.monotonic() - started:.1f} s) | {len(still)} | "
            f"{len(mounts(tmpdir))} | {len(at_end)} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", action="append")
    p.add_argument("--flood-bytes", type=int, default=2_000_000_000)
    p.add_argument("--no-kill", action="store_true", help="skip the killed-rollout phase")
    args = p.parse_args()
    run = cases(args.flood_bytes)
    if args.only:
        run = {k: v for k, v in run.items() if k in args.only}
    work = Path(tempfile.mkdtemp(prefix="plp-"))
    try:
        work.chmod(0o755)  # the sandbox uids traverse to their stage dirs under TMPDIR
        tmpdir = work / "t"
        tmpdir.mkdir()
        started = time.monotonic()
        out = _finish(_child(tmpdir, work / "store", run))
        if "failed" in out:
            raise SystemExit(f"the rollout failed: {out['failed']}")
        print(f"rollout of {len(run)} sessions: {time.monotonic() - started:.1f} s; rollout process peak RSS "
              f"{out['peak_mb']:.0f} MiB")
        print("| case | status | reward | failure | limit hit | by |\n|---|---|---|---|---|---|")
        for name, r in out["results"].items():
            print(row(name, r))
        print(f"after the rollout: runtime folders left {len(runtime_folders(tmpdir))}, tmpfs mounts left "
              f"{len(mounts(tmpdir))}, orphaned processes {len(wait_orphans(tmpdir))}")
        if not args.no_kill:
            print("\n| signal to a rollout holding a 3,000-level tree | victim | its processes | alive 30 s later "
                  "| runtime folders held / left at death | next rollout | folders left after it | mounts left "
                  "| TMPDIR processes left |")
            print("|---|---|---|---|---|---|---|---|---|")
            for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                print(kill_phase(work, sig), flush=True)
    finally:  # what a baseline leaves (mounts, trees too deep for shutil.rmtree): umount, then GNU rm
        for point in sorted(mounts(work), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)


if __name__ == "__main__":
    main()
