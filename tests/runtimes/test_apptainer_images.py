"""URI images on the Apptainer runtime (``runtimes/apptainer_images.py``): converted once per image
into the store as a sandbox folder, however many sessions ask at once. The locking and failure paths
run against a fake ``apptainer build`` (a script that counts its builds); the real test converts a
``docker-archive://`` of an image saved from the tests' own dockerd with the real binary, for three
concurrent runtimes, each of which then runs in it with the image's /testbed and ENV."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polar_env.errors import ConfigError
from polar_env.runtimes import ApptainerRuntime, RuntimeSpec
from polar_env.runtimes.apptainer_images import Converted, ensure_sandbox, meta_path, sandbox_path
from tests.conftest import DOCKER_IMAGE, REPO_ROOT, unavailable
from tests.runtimes.conftest import git

# `build --sandbox DIR URI`: one line per build into $FAKE_COUNT, two seconds' work, then DIR; a URI
# with "bad" in it fails as Apptainer does, one with "slow" takes long enough to be cancelled.
FAKE = """#!/bin/sh
[ "$1" = build ] || exit 2
shift
while [ "$1" != --sandbox ]; do shift; done
dir=$2 uri=$3
echo "$$ $uri $APPTAINER_CACHEDIR" >> "$FAKE_COUNT"
case "$uri" in *bad*) echo "INFO:    Fetching"; echo "FATAL:   no such image: $uri"; exit 255;; esac
case "$uri" in *slow*) echo $$ > "$FAKE_COUNT.pid"; sleep 60;; esac
sleep 2
mkdir -p "$dir/testbed" && echo made > "$dir/testbed/f"
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, Path]:
    """(fake binary, store, build count file)."""
    binary = tmp_path / "bin" / "apptainer"
    binary.parent.mkdir()
    binary.write_text(FAKE)
    binary.chmod(0o755)
    count = tmp_path / "count"
    monkeypatch.setenv("FAKE_COUNT", str(count))
    monkeypatch.delenv("APPTAINER_CACHEDIR", raising=False)
    return str(binary), tmp_path / "store", count


def _builds(count: Path) -> list[str]:
    return count.read_text().splitlines() if count.exists() else []


def test_concurrent_threads_tasks_and_processes_convert_once(fake: tuple[str, Path, Path]) -> None:
    binary, store, count = fake
    uri = "docker://example.org/x/y:1"
    code = ("import asyncio, sys; from pathlib import Path; from polar_env.runtimes.apptainer_images import ensure_sandbox; "
            "print(asyncio.run(ensure_sandbox(sys.argv[1], sys.argv[2], Path(sys.argv[3]))).built)")
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, binary, str(store)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT) for _ in range(3)]
    in_threads: list[Converted] = []

    def thread() -> None:
        in_threads.append(asyncio.run(ensure_sandbox(uri, binary, store)))

    threads = [threading.Thread(target=thread) for _ in range(2)]
    for t in threads:
        t.start()

    async def tasks() -> list[Converted]:
        return list(await asyncio.gather(*(ensure_sandbox(uri, binary, store) for _ in range(3))))

    in_tasks = asyncio.run(tasks())
    for t in threads:
        t.join(30)
    flags = [p.communicate(timeout=30)[0].strip() for p in procs]
    built = [c.built for c in (*in_threads, *in_tasks)] + [f == "True" for f in flags]
    assert len(built) == 8 and built.count(True) == 1, (built, flags)
    assert len(_builds(count)) == 1 and _builds(count)[0].endswith(str(store / ".apptainer-cache"))
    target = sandbox_path(uri, store)
    assert (target / "testbed" / "f").read_text() == "made\n"
    assert all(c.path == target for c in (*in_threads, *in_tasks))
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]
    meta = json.loads(meta_path(target).read_text())
    assert meta["uri"] == uri and meta["bytes"] > 0 and meta["build_s"] >= 2
    again = asyncio.run(ensure_sandbox(uri, binary, store))  # present: no lock, no build, the recorded size
    assert not again.built and again.bytes == meta["bytes"] and len(_builds(count)) == 1


def test_a_failed_conversion_is_one_line_and_leaves_no_half_image(fake: tuple[str, Path, Path]) -> None:
    binary, store, count = fake
    uri = "docker://example.org/bad:1"
    store.mkdir()
    crashed = store / f"{sandbox_path(uri, store).name}.tmp-1-2"  # an earlier build that died mid-way
    (crashed / "etc").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        asyncio.run(ensure_sandbox(uri, binary, store))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"apptainer: cannot convert {uri} into a sandbox folder (exit 255): FATAL:")
    assert "no such image" in line and "apptainer build --sandbox" in line
    logfile = Path(line.split("full log: ")[1].split(";")[0])
    assert "INFO:    Fetching" in logfile.read_text()
    assert not sandbox_path(uri, store).exists() and not [p for p in store.iterdir() if ".tmp-" in p.name]
    assert len(_builds(count)) == 1


def test_a_cancelled_conversion_kills_the_build_and_frees_the_lock(fake: tuple[str, Path, Path]) -> None:
    binary, store, count = fake
    uri = "docker://example.org/slow:1"

    async def run() -> None:
        task = asyncio.ensure_future(ensure_sandbox(uri, binary, store))
        pidfile = Path(f"{count}.pid")
        deadline = time.monotonic() + 20
        while not pidfile.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pidfile.exists(), "the fake build never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pid = int(pidfile.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not [p for p in store.iterdir() if ".tmp-" in p.name]
        with open(store / f".{sandbox_path(uri, store).name}.lock") as f:  # free: another session may build
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

    asyncio.run(run())


def test_an_unwritable_store_is_one_line(fake: tuple[str, Path, Path], tmp_path: Path) -> None:
    binary, _, _ = fake
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot write the image store .*; set POLAR_IMAGES to a writable folder$"):
        asyncio.run(ensure_sandbox("docker://x/y:1", binary, tmp_path / "file" / "store"))


# ----- the real binary: a docker save archive, three runtimes at once -----------------------------------


@pytest.fixture
def archive(docker_host: str, tmp_path: Path) -> str:
    """``docker save`` of a small image FROM the test image: a committed /testbed, an ENV."""
    ctx = tmp_path / "ctx"
    testbed = ctx / "testbed"
    testbed.mkdir(parents=True)
    (testbed / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git(testbed, "init", "-q")
    git(testbed, "add", "-A")
    git(testbed, "commit", "-q", "-m", "base")
    (ctx / "Dockerfile").write_text(f"FROM {DOCKER_IMAGE}\nCOPY testbed /testbed\nENV POLAR_MARK=from-the-image\n")
    tag = "polar-test/archive:1"
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    for argv in (["docker", "build", "-q", "-t", tag, str(ctx)], ["docker", "save", tag, "-o", str(tmp_path / "saved.tar")]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
        if proc.returncode != 0:
            unavailable(f"{' '.join(argv[:2])} failed: {proc.stderr.strip()[-500:]}")
    return f"docker-archive://{tmp_path / 'saved.tar'}"


@pytest.mark.slow
async def test_docker_archive_is_converted_once_for_three_concurrent_runtimes(
        apptainer: str, archive: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv("POLAR_IMAGES", str(store))
    rts = [ApptainerRuntime(RuntimeSpec(kind="apptainer", image=archive, network="none"), binary=apptainer) for _ in range(3)]
    start = time.monotonic()
    try:
        await asyncio.gather(*(rt.prepare() for rt in rts))
        reports = [rt.limits_report()["image"] for rt in rts]
        assert [r["built"] for r in reports].count(True) == 1, reports
        built = next(r for r in reports if r["built"])
        assert built["sandbox"] == str(sandbox_path(archive, store)) and 100e6 < built["bytes"] < 2e9
        print(f"docker-archive conversion: {built['build_s']:.1f} s, {built['bytes'] / 1e6:.1f} MB on disk; "
              f"3 prepares {time.monotonic() - start:.1f} s")
        for rt in rts:
            assert (rt.workspace / "calc.py").read_text().startswith("def add")  # the image's /testbed
            res = await rt.exec("cat /etc/os-release; echo $POLAR_MARK; id -u; git -c safe.directory='*' log --format=%s")
            assert res.exit_code == 0 and 'VERSION_CODENAME=bookworm' in res.output, res.output
            assert res.output.split()[-3:] == ["from-the-image", str(rt.uid if rt.uid is not None else os.geteuid()), "base"]
    finally:
        for rt in rts:
            await rt.stop()
    assert not [p for p in (store / ".apptainer-cache").rglob("*") if p.is_file()]  # a local archive is not cached
    again = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=archive, network="none"), binary=apptainer)
    await again.prepare()
    try:
        assert again.limits_report()["image"]["built"] is False
    finally:
        await again.stop()
