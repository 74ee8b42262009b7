"""``polar-env images build --kind sif``: a real build of one real SWE row (shared/swe-real's
pallets__click-2223, as tests/tasks/test_image_build.py builds it for the rootfs kind) into a temp
store, then the SIF checked without FUSE (its labels by ``apptainer inspect``, its squashfs listed
and read by ``unsquashfs`` at the offset ``apptainer sif list`` gives), and run with ``apptainer
exec --userns`` where the caller can open /dev/fuse (root here: squashfuse mounts it); the bundle
itself, with the env scripts the build writes into it, on the Apptainer runtime.

Needs what the rootfs build needs (the debootstrap rootfs, bubblewrap, a warm uv cache or the
package index) plus apptainer (scripts/install_apptainer.sh) and squashfs-tools.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import main
from polar_env.runtimes import ApptainerRuntime, RuntimeSpec
from polar_env.runtimes.apptainer import find_apptainer
from polar_env.runtimes.bundle import read_image_dir, store_name
from polar_env.tasks.image_build import IMAGE_ENV, STAMP_KEY
from polar_env.tasks.image_sif import BASE_SCRIPT, ENV_SCRIPT, env_script, sif_labels
from tests.conftest import require_bwrap, unavailable
from tests.tasks.test_image_build import ROW, SWE_REAL, _rows, _task

pytestmark = pytest.mark.slow


def _build(store: Path, rootfs: Path) -> tuple[int, dict[str, Any], list[str], float]:
    """``images build --kind sif --json`` of the row: (exit, JSON, stderr lines, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["images", "build", str(_rows()), "--ids", ROW, "--base", str(rootfs), "--repos", str(SWE_REAL / "repos"),
                   "--store", str(store), "--kind", "sif", "--json"])
    return rc, json.loads(out.getvalue() or "{}"), err.getvalue().strip().splitlines(), time.monotonic() - start


@pytest.fixture(scope="module")
def apptainer() -> str:
    found = find_apptainer()
    if found is None:
        unavailable("no apptainer binary (on PATH or built by scripts/install_apptainer.sh): run that script")
    if shutil.which("unsquashfs") is None:
        unavailable("squashfs-tools is not installed (apt-get install -y squashfs-tools)")
    assert found is not None
    return found


@pytest.fixture(scope="module")
def built(apptainer: str, rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[str]]:
    require_bwrap()
    store = tmp_path_factory.mktemp("images")
    rc, summary, err, seconds = _build(store, rootfs)
    assert rc == 0 and not summary["failed"], (summary, err)
    print(f"images build --kind sif: {seconds:.1f} s ({err[-1]})")
    return store, summary["images"][0], err


def _squashfs_offset(apptainer: str, sif: Path) -> int:
    """Where the SIF's root filesystem partition starts (``apptainer sif list``'s FS row)."""
    listing = subprocess.run([apptainer, "sif", "list", str(sif)], capture_output=True, text=True, check=True).stdout
    row = next(ln for ln in listing.splitlines() if "FS (Squashfs" in ln)
    return int(row.split("|")[3].split("-")[0])


def test_the_sif_holds_the_bundle_with_its_env_and_stamp(apptainer: str, built: tuple[Path, dict[str, Any], list[str]]) -> None:
    store, image, err = built
    name = store_name(_task().image or "")
    sif = store / f"{name}.sif"
    assert image["kind"] == "sif" and not image["skipped"] and "sif" in image["stages_s"]
    assert image["sif_bytes"] == sif.stat().st_size and 20e6 < sif.stat().st_size < 1e9
    assert f"sif {sif.stat().st_size / 1e6:.1f} MB" in err[-1], err
    bundle = read_image_dir(store / name)
    assert (bundle.rootfs / ENV_SCRIPT).read_text() == env_script(IMAGE_ENV)  # the rootfs kind's part too
    assert sif_labels(apptainer, sif)[STAMP_KEY] == bundle.annotations[STAMP_KEY]
    offset = str(_squashfs_offset(apptainer, sif))
    listing = subprocess.run(["unsquashfs", "-o", offset, "-l", str(sif)], capture_output=True, text=True, check=True).stdout
    members = set(listing.split())
    for path in ("opt/venv/bin/pytest", "testbed/.git", "testbed/src/click/core.py", ENV_SCRIPT, ".singularity.d/actions/exec"):
        assert f"squashfs-root/{path}" in members, path
    script = subprocess.run(["unsquashfs", "-o", offset, "-cat", str(sif), ENV_SCRIPT], capture_output=True, text=True, check=True)
    assert script.stdout == env_script(IMAGE_ENV) and "export PATH=/opt/venv/bin:" in script.stdout
    assert not [p.name for p in store.iterdir() if ".tmp-" in p.name]


def test_a_current_sif_is_not_rebuilt(built: tuple[Path, dict[str, Any], list[str]], rootfs: Path) -> None:
    store, image, _ = built
    sif = store / f"{store_name(_task().image or '')}.sif"
    inode = sif.stat().st_ino
    rc, summary, err, seconds = _build(store, rootfs)
    assert rc == 0 and summary["images"][0]["skipped"] and "up to date" in err[-1], err
    assert summary["images"][0]["sif_bytes"] == image["sif_bytes"] and sif.stat().st_ino == inode and seconds < 15


def test_the_sif_runs_the_rows_pytest(apptainer: str, built: tuple[Path, dict[str, Any], list[str]]) -> None:
    """Rootless Apptainer mounts a SIF with squashfuse: only where the caller opens /dev/fuse."""
    if shutil.which("squashfuse") is None or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        unavailable("running a SIF needs squashfuse and /dev/fuse open to this user")
    store, _, _ = built
    sif = store / f"{store_name(_task().image or '')}.sif"
    script = 'command -v pytest; echo "$VIRTUAL_ENV $MARK"; pytest --version 2>&1; git -c safe.directory="*" rev-list --count HEAD'
    ran = subprocess.run([apptainer, "exec", "--userns", "--containall", "--cleanenv", "--pwd", "/testbed", str(sif), "sh", "-c", script],
                         capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "APPTAINERENV_MARK": "caller"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["/opt/venv/bin/pytest", "/opt/venv", "caller", "pytest", "7.1.1", "1"], ran.stdout + ran.stderr


async def test_the_bundle_keeps_the_callers_env_on_the_apptainer_runtime(apptainer: str,
                                                                         built: tuple[Path, dict[str, Any], list[str]]) -> None:
    """The rootfs kind's .singularity.d/env must not cost the caller its variables: Apptainer drops
    APPTAINERENV_* from a folder that has env scripts but no 99-base.sh."""
    store, _, _ = built
    bundle = store / store_name(_task().image or "")
    assert (bundle / "rootfs" / BASE_SCRIPT).is_file()
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(bundle), network="none"), binary=apptainer)
    await rt.prepare()
    try:
        path = f"/opt/polar/bin:{rt.path}"  # as harnesses/launch.py passes it
        res = await rt.exec('echo "$MARK"; echo "$PATH"; command -v pytest', env={"MARK": "from-the-caller", "PATH": path})
        assert res.exit_code == 0 and res.output.split() == ["from-the-caller", path, "/opt/venv/bin/pytest"], res.output
    finally:
        await rt.stop()
