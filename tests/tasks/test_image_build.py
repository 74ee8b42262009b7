"""``polar-env images build`` / ``unpack``: a real recipe build of one real SWE row (shared/swe-real's
pallets__click-2223: uv venv + its install line, packages as of its fix date) into a temp store, graded
inside the image under bubblewrap; and unpacking saved images (docker save, OCI layout, Apptainer
sandbox) made here with tarfile, with whiteouts and members that try to leave the rootfs.

The build needs the debootstrap rootfs (tests/conftest.py's ``rootfs``), bubblewrap, and the package
index (or a warm uv cache); the docker test the private dockerd of ``docker_host``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import main
from polar_env.errors import ConfigError
from polar_env.runtimes.bundle import is_bundle, read_image_dir, store_name
from polar_env.tasks.image_build import (
    IMAGE_ENV,
    TESTBED,
    Builder,
    BuildOptions,
    BuildResult,
    bwrap_argv,
    check_base_image,
    pytest_argv,
)
from polar_env.tasks.image_unpack import parse_export, unpack
from polar_env.tasks.sources import load_swe_tasks
from polar_env.tasks.swe import SweTask
from tests.conftest import REPO_ROOT, require_bwrap, unavailable

pytestmark = pytest.mark.slow

SWE_REAL = Path(os.environ.get("POLAR_SWE_REAL") or REPO_ROOT.parent / "shared" / "swe-real")
ROW = "pallets__click-2223"
# build_env.sh's repo for this row has this id too: same tree, author, date and message
CLICK_COMMIT = "00dce5afedb02b95b2859352824897b1b885070f"


def _rows() -> Path:
    if not (SWE_REAL / "instances.jsonl").is_file():
        unavailable(f"no swe-real set at {SWE_REAL} (set POLAR_SWE_REAL)")
    return SWE_REAL / "instances.jsonl"


def _task() -> SweTask:
    return next(t for t in load_swe_tasks(_rows()) if t.instance_id == ROW)


def _options(store: Path, base: Path, **fields: Any) -> BuildOptions:
    return BuildOptions.from_env(os.environ, store=store, base=base, repos=SWE_REAL / "repos", **fields)


@pytest.fixture(scope="module")
def built(rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Builder, BuildResult]:
    require_bwrap()
    builder = Builder(_options(tmp_path_factory.mktemp("images"), rootfs))
    return builder, builder.build(_task())


def _sh(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False, **kw)


def test_the_bundle_is_named_as_the_rows_image_with_the_venv_first(built: tuple[Builder, BuildResult]) -> None:
    builder, result = built
    task = _task()
    assert task.image == "docker.io/xingyaoww/sweb.eval.x86_64.pallets_s_click-2223:latest"
    bundle = builder.opts.store / store_name(task.image)
    assert result.bundle == bundle and is_bundle(bundle) and not result.skipped
    image = read_image_dir(bundle)
    assert image.env["PATH"].startswith("/opt/venv/bin:") and image.env["VIRTUAL_ENV"] == "/opt/venv"
    assert image.cwd == TESTBED and image.annotations["polar_env.image.source"] == "environment_setup"
    assert result.pytest == "pytest 7.1.1"  # the row's pytest_version, from the venv
    assert set(result.stages) == {"copy", "repo", "venv", "install", "verify"}
    assert result.unique_bytes is not None and 1e6 < result.unique_bytes < 100e6  # shares the base's files
    assert [p.name for p in builder.opts.store.iterdir() if ".building-" in p.name] == []


def test_testbed_is_one_reproducible_commit(built: tuple[Builder, BuildResult], rootfs: Path, tmp_path: Path) -> None:
    _, result = built
    testbed = result.bundle / "rootfs" / "testbed"
    git = ["git", "-c", f"safe.directory={testbed}", "-C", str(testbed)]
    assert _sh([*git, "rev-list", "--count", "HEAD"]).stdout.strip() == "1"
    assert _sh([*git, "rev-parse", "HEAD"]).stdout.strip() == result.commit == CLICK_COMMIT
    again = Builder(_options(tmp_path / "store2", rootfs)).build(_task())  # a fresh store: a second full build
    assert again.commit == CLICK_COMMIT and not again.skipped


def _run_tests(bundle: Path, tmp_path: Path, patches: list[str]) -> subprocess.CompletedProcess[str]:
    """The row's test command in the image (read-only) on a scratch copy of /testbed with ``patches``."""
    work = tmp_path / "testbed"
    shutil.copytree(bundle / "rootfs" / "testbed", work, symlinks=True)
    for patch in patches:
        applied = _sh(["git", "-c", f"safe.directory={work}", "-C", str(work), "apply", "-"], input=patch)
        assert applied.returncode == 0, applied.stderr
    command = json.loads(next(ln for ln in _rows().read_text().splitlines() if ROW in ln))["environment_setup"]["test_command"]
    argv = bwrap_argv(bundle / "rootfs", ["sh", "-c", command], env={**IMAGE_ENV, "HOME": "/root"}, cwd=TESTBED,
                      binds=[("--bind", work, TESTBED)])
    return _sh(argv, timeout=300)


def test_the_rows_tests_pass_in_the_image_with_the_gold_patch_and_fail_without(built: tuple[Builder, BuildResult],
                                                                                tmp_path: Path) -> None:
    _, result = built
    task = _task()
    fixed = _run_tests(result.bundle, tmp_path / "gold", [task.test_patch, task.patch])
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    for test in task.FAIL_TO_PASS:
        assert f"PASSED {test}" in fixed.stdout, test
    broken = _run_tests(result.bundle, tmp_path / "base", [task.test_patch])
    assert broken.returncode == 1 and f"FAILED {task.FAIL_TO_PASS[0]}" in broken.stdout, broken.stdout[-3000:]


def test_a_second_build_of_a_current_image_is_skipped(built: tuple[Builder, BuildResult]) -> None:
    builder, result = built
    inode = (result.bundle / "config.json").stat().st_ino
    again = builder.build(_task())
    assert again.skipped and again.commit == result.commit and again.stages == {}  # no stage ran
    assert (result.bundle / "config.json").stat().st_ino == inode  # untouched
    assert "up to date" in again.line()


def test_a_failing_install_line_is_one_line_with_its_last_output_and_log(built: tuple[Builder, BuildResult]) -> None:
    builder, _ = built
    row = json.loads(next(ln for ln in _rows().read_text().splitlines() if ROW in ln))
    row["environment_setup"]["install"] = ["echo resolving >&2", "echo 'no solution for pytest==0.0.1' >&2; exit 3"]
    row["image_name"] = "local/broken:1"
    with pytest.raises(ConfigError) as err:
        builder.build(SweTask.from_row(row))
    message = str(err.value)
    assert message.startswith("install line failed (exit 3): no solution for pytest==0.0.1; full log: ")
    log = Path(message.rsplit("full log: ", 1)[1])
    assert "resolving" in log.read_text() and "\n" not in message
    store = builder.opts.store
    assert not (store / store_name("local/broken:1")).exists()  # no half image under the name
    assert [p.name for p in store.iterdir() if ".building-" in p.name] == []


def test_an_install_line_cannot_write_into_the_shared_base(built: tuple[Builder, BuildResult]) -> None:
    """The image's rootfs is hardlinked from the base: an install line that appends to a system file
    in place would change the base every image shares. Only /testbed and the venv are writable."""
    builder, _ = built
    target = builder.opts.base / "etc" / "debian_version"
    before = target.read_bytes()
    row = json.loads(next(ln for ln in _rows().read_text().splitlines() if ROW in ln))
    row["environment_setup"]["install"] = ["echo forged >> /etc/debian_version"]
    row["image_name"] = "local/base-writer:1"
    with pytest.raises(ConfigError, match="install line failed"):
        builder.build(SweTask.from_row(row))
    assert target.read_bytes() == before


def _cli_rows(tmp_path: Path, **change: Any) -> Path:
    row = json.loads(next(ln for ln in _rows().read_text().splitlines() if ROW in ln))
    row.update(change)
    if change.get("environment_setup") is None:
        row.pop("environment_setup")
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_a_row_without_environment_setup_is_refused_in_one_line(rootfs: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    rows = _cli_rows(tmp_path, environment_setup=None)
    store = tmp_path / "store"
    rc = main(["images", "build", str(rows), "--ids", ROW, "--base", str(rootfs), "--repos", str(SWE_REAL / "repos"),
               "--store", str(store)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"polar-env images: error: {ROW}: the row has no environment_setup to build from; run its "
                             "published image docker.io/xingyaoww/sweb.eval.x86_64.pallets_s_click-2223:latest"), err[0]
    assert "images unpack" in err[0] and not any(p.name.startswith("docker.io") for p in store.glob("*"))


def test_a_missing_repo_tarball_is_one_line(rootfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    empty = tmp_path / "repos"
    empty.mkdir()
    rc = main(["images", "build", str(_rows()), "--ids", ROW, "--base", str(rootfs), "--repos", str(empty),
               "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"has neither {ROW}.tar.gz" in err[0], err


def test_pytest_argv_finds_the_invocation() -> None:
    assert pytest_argv("pytest -rA tests/test_options.py") == ["pytest"]
    assert pytest_argv("PYTHONWARNINGS=ignore python -m pytest -p no:pretty t.py") == ["python", "-m", "pytest"]
    assert pytest_argv("tox -e py") == ["python", "-m", "pytest"]


def test_docker_kind_builds_the_rows_image_on_the_imported_base(built: tuple[Builder, BuildResult], rootfs: Path,
                                                                docker_host: str) -> None:
    builder, _ = built
    opts = _options(builder.opts.store, rootfs, kind="docker")
    image = _task().image
    assert image is not None
    _sh(["docker", "rmi", "-f", image])  # an earlier run's image of this name would be current
    result = Builder(opts).build(_task())
    assert "docker build" in result.stages and not result.skipped, result
    assert result.layer_bytes is not None and 1e6 < result.layer_bytes < 100e6
    labels = json.loads(_sh(["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", image]).stdout)
    assert labels["polar_env.image.source"] == "environment_setup"
    ran = _sh(["docker", "run", "--rm", "--network", "none", image, "sh", "-c", "pwd; pytest --version"], timeout=120)
    assert ran.returncode == 0 and ran.stdout.split() == ["/testbed", "pytest", "7.1.1"], ran.stdout + ran.stderr
    assert Builder(opts).build(_task()).skipped  # current: neither the bundle nor the image is rebuilt
    saved = builder.opts.store.parent / "saved.tar"  # a real docker save archive, unpacked and run under bwrap
    assert _sh(["docker", "save", image, "-o", str(saved)], timeout=300).returncode == 0
    unpacked = unpack(saved, image, builder.opts.store.parent / "unpacked")
    assert unpacked.layers == 3 and all(d.startswith("./dev/") for d in unpacked.dropped), unpacked.dropped  # device nodes
    bundle = read_image_dir(unpacked.bundle)
    assert bundle.env == IMAGE_ENV and bundle.cwd == TESTBED
    ran = _sh(bwrap_argv(bundle.rootfs, ["sh", "-c", "pytest --version; git rev-parse HEAD"], env=bundle.env, cwd=TESTBED))
    assert ran.stdout.split() == ["pytest", "7.1.1", CLICK_COMMIT], ran.stdout + ran.stderr
    with pytest.raises(ConfigError, match="is not an import of --base"):
        check_base_image(opts.base_image, "include=something-else", rootfs)


# -- unpack ------------------------------------------------------------------------------------------


def _tar(entries: list[tuple[str, bytes | str | None]], *, compress: bool = False) -> bytes:
    """A layer: (name, bytes) files, (name, None) folders, (name, "->target") symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data.removeprefix("->")
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw) if compress else raw


LAYERS = [
    [("app", None), ("app/keep.txt", b"keep"), ("app/old.txt", b"old"), ("opq", None), ("opq/a.txt", b"a"),
     ("usr", None), ("usr/bin", None), ("usr/bin/python3", "->/usr/bin/python3.11"), ("etcl", "->/etc"),
     ("certs", None), ("certs/a.pem", "->/usr/share/ca/a.crt"), ("certs/h.0", "->a.pem")],  # a link through an absolute one
    [("app/.wh.old.txt", b""), ("opq/.wh..wh..opq", b""), ("opq/b.txt", b"b"), ("../evil.txt", b"evil"),
     ("etcl/polar-evil", b"evil"), ("app/new.txt", b"new"), ("up", "->../../../../tmp"), ("up/polar-evil", b"evil")],
]
CONFIG = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "FOO=bar=baz"],
                                                              "WorkingDir": "/app"}}


def _check_unpacked(bundle: Path, tmp_path: Path, dropped: list[str]) -> None:
    root = bundle / "rootfs"
    assert (root / "app" / "keep.txt").read_bytes() == b"keep" and (root / "app" / "new.txt").read_bytes() == b"new"
    assert not (root / "app" / "old.txt").exists() and not (root / "app" / ".wh.old.txt").exists()  # whiteout
    assert sorted(p.name for p in (root / "opq").iterdir()) == ["b.txt"]  # opaque: lower a.txt gone, own b.txt kept
    assert os.readlink(root / "usr" / "bin" / "python3") == "/usr/bin/python3.11"  # absolute links kept as they are
    assert os.readlink(root / "certs" / "h.0") == "a.pem" and os.readlink(root / "certs" / "a.pem") == "/usr/share/ca/a.crt"
    assert not (root.parent / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
    assert not Path("/etc/polar-evil").exists() and not Path("/tmp/polar-evil").exists()
    assert os.readlink(root / "up") == "../../../../tmp"  # a link writes nothing; writes through it are dropped
    assert {d.split(" ")[0] for d in dropped} == {"../evil.txt", "etcl/polar-evil", "up/polar-evil"}
    image = read_image_dir(bundle)
    assert image.env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "FOO": "bar=baz"} and image.cwd == "/app"


def test_unpack_a_docker_save_archive(tmp_path: Path) -> None:
    archive = tmp_path / "saved.tar"
    with tarfile.open(archive, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("cfg.json", json.dumps(CONFIG).encode())
        add("l1/layer.tar", _tar(LAYERS[0]))
        add("l2/layer.tar", _tar(LAYERS[1], compress=True))
        manifest = [{"Config": "cfg.json", "RepoTags": ["x/y:1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]}]
        add("manifest.json", json.dumps(manifest).encode())
    result = unpack(archive, "docker.io/x/y:1", tmp_path / "store")
    assert result.bundle == tmp_path / "store" / "docker.io_x_y_1" and result.layers == 2 and result.source == "docker-save"
    _check_unpacked(result.bundle, tmp_path, result.dropped)
    assert "dropped" in result.line()
    again = unpack(archive, "docker.io/x/y:1", tmp_path / "store")  # replaces the bundle of that name
    assert again.bundle == result.bundle and [p.name for p in (tmp_path / "store").iterdir() if "unpacking" in p.name] == []


def test_unpack_an_oci_layout(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)

    def blob(data: bytes, media: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (layout / "blobs" / "sha256" / digest).write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    manifest = {"schemaVersion": 2, "config": blob(json.dumps(CONFIG).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": [blob(_tar(LAYERS[0], compress=True), "application/vnd.oci.image.layer.v1.tar+gzip"),
                           blob(_tar(LAYERS[1]), "application/vnd.oci.image.layer.v1.tar")]}
    index = {"schemaVersion": 2, "manifests": [{**blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json"),
                                                "platform": {"architecture": "amd64", "os": "linux"}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    result = unpack(layout, "x/y:oci", tmp_path / "store")
    assert result.source == "oci-layout" and result.layers == 2
    _check_unpacked(result.bundle, tmp_path, result.dropped)


def test_unpack_an_apptainer_sandbox_takes_the_export_lines_it_can_parse(tmp_path: Path) -> None:
    sandbox = tmp_path / "sandbox"
    (sandbox / ".singularity.d" / "env").mkdir(parents=True)
    (sandbox / "testbed").mkdir()
    (sandbox / "testbed" / "f.py").write_text("x = 1\n")
    (sandbox / ".singularity.d" / "env" / "10-docker2singularity.sh").write_text(
        '#!/bin/sh\nexport PATH="/usr/local/bin:/usr/bin:/bin"\nexport VIRTUAL_ENV=/opt/venv\n')
    (sandbox / ".singularity.d" / "env" / "90-environment.sh").write_text(
        'export PATH="/opt/venv/bin:$PATH"\nexport LIT=\'$HOME stays\'\nif [ -z "$LANG" ]; then\n  export LANG=C\nfi\n'
        'export D="${UNSET:-x}"\n')
    result = unpack(sandbox, "local/sandbox:1", tmp_path / "store")
    image = read_image_dir(result.bundle)
    assert (image.rootfs / "testbed" / "f.py").read_text() == "x = 1\n"
    assert image.env == {"PATH": "/opt/venv/bin:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": "/opt/venv",
                         "LIT": "$HOME stays"}
    assert [n.split(": ", 1)[1] for n in result.not_parsed] == ['if [ -z "$LANG" ]; then', "export LANG=C", "fi",
                                                                 'export D="${UNSET:-x}"']
    assert parse_export("export A=1 B=2", {}) is None and parse_export("echo hi", {}) is None


def test_unpack_refuses_what_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk").write_text("not an image")
    with pytest.raises(ConfigError, match="is neither a docker save archive"):
        unpack(tmp_path / "junk", "x/y:1", tmp_path / "store")
    with pytest.raises(ConfigError, match="no such file or folder"):
        unpack(tmp_path / "missing.tar", "x/y:1", tmp_path / "store")
