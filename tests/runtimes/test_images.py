"""SWE images on every runtime: an OCI bundle (``config.json`` + ``rootfs/``, runtimes/bundle.py) or
a store name runs on the sandbox and Apptainer with the image's ``/testbed`` as the workspace and
the image's ``ENV`` as the environment; Docker reads its image's ``ENV PATH``; every runtime's
``path`` is what ``harnesses/launch.py`` puts the harness on; missing images are one line, at
prepare and (all of them) at preflight."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_env import preflight
from polar_env.errors import ConfigError
from polar_env.runtimes import ApptainerRuntime, DockerRuntime, RuntimeSpec, SandboxRuntime
from polar_env.runtimes.bundle import store_name, write_bundle_config
from polar_env.runtimes.imagestore import extract_stream
from tests.conftest import DOCKER_IMAGE, require_bwrap, unavailable
from tests.runtimes.conftest import git

VENV_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HELLO = "#!/bin/sh\necho hello from the image venv\n"


def make_bundle(rootfs: Path, dest: Path) -> Path:
    """A bundle from the test rootfs, hardlinked (fast): a committed /testbed and a fake venv on its PATH."""
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(rootfs), str(dest / "rootfs")], check=True)
    testbed = dest / "rootfs" / "testbed"
    testbed.mkdir(exist_ok=True)  # the test rootfs has an empty mount point
    (testbed / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (testbed / "link").symlink_to("calc.py")
    git(testbed, "init", "-q")
    git(testbed, "add", "-A")
    git(testbed, "commit", "-q", "-m", "base")
    venv = dest / "rootfs" / "opt" / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "hello").write_text(HELLO)
    (venv / "hello").chmod(0o755)
    write_bundle_config(dest, env={"PATH": VENV_PATH, "VIRTUAL_ENV": "/opt/venv"}, cwd="/testbed")
    return dest


@pytest.fixture
def bundle(rootfs: Path, tmp_path: Path) -> Path:
    return make_bundle(rootfs, tmp_path / "bundle")


async def check_image_runtime(rt: SandboxRuntime | ApptainerRuntime) -> None:
    """The workspace is the image's /testbed (clean), the image's env and PATH are the agent's."""
    await rt.prepare()
    try:
        assert (rt.workspace / "calc.py").is_file() and (rt.workspace / "link").is_symlink()
        res = await rt.exec("git -c safe.directory='*' status --porcelain; git -c safe.directory='*' log --format=%s")
        assert res.exit_code == 0 and res.output.strip() == "base", res.output
        assert rt.path.startswith("/opt/venv/bin:")
        res = await rt.exec(["hello"])  # no PATH passed: the image's
        assert res.exit_code == 0 and "hello from the image venv" in res.output, res.output
        res = await rt.exec("echo $VIRTUAL_ENV; echo $HOME", env={"PATH": rt.path})  # as launch.py passes it
        assert res.output.split() == ["/opt/venv", "/root"], res.output
        # localhost resolves, as in a container (the test rootfs has no /etc/hosts; servers a suite starts
        # by name, e.g. pytest-httpbin's, need it)
        res = await rt.exec(["python3", "-c", "import socket; print(socket.getaddrinfo('localhost', 80)[0][4][0])"])
        assert res.exit_code == 0 and res.output.strip() in ("127.0.0.1", "::1"), res.output
        await rt.write_file("/testbed/calc.py", b"changed\n")
        assert "+changed" in await rt.diff()
    finally:
        await rt.stop()


async def test_sandbox_runs_a_bundle(bundle: Path) -> None:
    require_bwrap()
    rt = SandboxRuntime(RuntimeSpec(image=str(bundle), network="none"))
    await check_image_runtime(rt)
    assert not (bundle / "rootfs" / "testbed" / "new").exists()


async def test_sandbox_finds_a_name_in_the_store(bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_bwrap()
    name = "docker.io/xingyaoww/sweb.eval.x86_64.pallets_s_click-2223:latest"
    store = tmp_path / "store"
    store.mkdir()
    bundle.rename(store / store_name(name))
    monkeypatch.setenv("POLAR_IMAGES", str(store))
    await check_image_runtime(SandboxRuntime(RuntimeSpec(image=name, network="none")))
    missing = SandboxRuntime(RuntimeSpec(image="docker.io/x/absent:1", network="none"))
    with pytest.raises(ConfigError) as exc:
        await missing.prepare()
    line = str(exc.value)
    assert "\n" not in line and str(store / "docker.io_x_absent_1") in line
    assert "polar-env images build" in line and "polar-env images unpack ARCHIVE --name docker.io/x/absent:1" in line
    with pytest.raises(ConfigError) as exc:
        preflight.check_runtime("sandbox", images=[name, "docker.io/x/absent:1", name, "docker.io/x/gone:2", "/no/dir"])
    line = str(exc.value)
    assert "\n" not in line and line.startswith("3 sandbox images missing: docker.io/x/absent:1 is not in the image store")
    assert "--name docker.io/x/gone:2" in line and "/no/dir does not exist" in line and f"{name} " not in line


async def test_sandbox_task_repo_wins_over_the_image(bundle: Path, task_repo: Path) -> None:
    """``source_dir`` (toy tasks) is copied instead of the image's /testbed."""
    require_bwrap()
    rt = SandboxRuntime(RuntimeSpec(image=str(bundle), source_dir=task_repo, network="none"))
    await rt.prepare()
    try:
        assert (rt.workspace / "pkg" / "mod.py").is_file() and not (rt.workspace / "link").exists()
    finally:
        await rt.stop()


@pytest.mark.slow
async def test_real_apptainer_runs_a_bundle(apptainer: str, bundle: Path) -> None:
    await check_image_runtime(ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(bundle), network="none"),
                                               binary=apptainer))


@pytest.mark.slow
async def test_real_apptainer_copies_a_workdir_out_of_an_image_without_a_folder(apptainer: str, bundle: Path,
                                                                              tmp_path: Path) -> None:
    """A SIF has no host folder: its /testbed is tarred out through the image into the workspace."""
    if not os.path.exists("/dev/fuse") or os.stat("/dev/fuse").st_mode & 0o006 != 0o006:
        pytest.skip("a SIF needs /dev/fuse open to unprivileged uids (squashfuse)")
    sif = tmp_path / "img.sif"
    proc = subprocess.run([apptainer, "build", str(sif), str(bundle / "rootfs")], capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        pytest.skip(f"apptainer build cannot make a SIF here: {proc.stderr.strip()[-300:]}")
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(sif), network="none"), binary=apptainer)
    await rt.prepare()
    try:
        assert (rt.workspace / "calc.py").read_text().startswith("def add") and (rt.workspace / "link").is_symlink()
        res = await rt.exec("git -c safe.directory='*' status --porcelain")
        assert res.exit_code == 0 and res.output.strip() == "", res.output
    finally:
        await rt.stop()


@pytest.mark.slow
async def test_real_apptainer_tars_the_workdir_out_through_the_image(apptainer: str, bundle: Path) -> None:
    """The SIF / docker:// path on a host where SIFs cannot mount (/dev/fuse 0600): the same image
    as a folder the runtime is told it cannot read, so /testbed comes out through ``tar`` in the image."""

    class NoHostFolder(ApptainerRuntime):
        def _check(self) -> None:
            super()._check()
            self._image = None  # as for a SIF: apptainer runs the rootfs, the host does not copy from it

    rt = NoHostFolder(RuntimeSpec(kind="apptainer", image=str(bundle / "rootfs"), network="none"), binary=apptainer)
    await rt.prepare()
    try:
        assert (rt.workspace / "calc.py").read_text().startswith("def add") and (rt.workspace / "link").is_symlink()
        if rt.uid is not None:
            assert (rt.workspace / "calc.py").stat().st_uid == rt.uid  # the agent's, not root's
        res = await rt.exec("git -c safe.directory='*' status --porcelain; git -c safe.directory='*' log --format=%s")
        assert res.exit_code == 0 and res.output.strip() == "base", res.output
        assert "/usr/bin" in rt.path  # read from the image at prepare (no bundle env here)
    finally:
        await rt.stop()
    empty = NoHostFolder(RuntimeSpec(kind="apptainer", image=str(bundle / "rootfs"), workdir="/nowhere", network="none"),
                         binary=apptainer)
    await empty.prepare()  # no such folder in the image: an empty workspace, no error
    try:
        assert not any(p for p in empty.workspace.iterdir() if p.name != ".git")
    finally:
        await empty.stop()


def test_extract_stream_refuses_escapes(tmp_path: Path) -> None:
    """The image's tar is untrusted: a name leaving the workspace is refused, a device skipped."""
    import io
    import tarfile

    def tar_of(*members: tarfile.TarInfo) -> io.BufferedReader:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
        buf.seek(0)
        return io.BufferedReader(buf)  # type: ignore[arg-type]

    ok = tarfile.TarInfo("./a.txt")
    ok.size = 1
    dev = tarfile.TarInfo("./null")
    dev.type = tarfile.CHRTYPE
    dest = tmp_path / "ws"
    dest.mkdir()
    assert extract_stream(tar_of(ok, dev), dest) == 1 and (dest / "a.txt").read_text() == "x"
    assert not (dest / "null").exists()
    link = tarfile.TarInfo("./out")
    link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path)
    through = tarfile.TarInfo("./out/owned")
    through.size = 1
    with pytest.raises(tarfile.TarError):
        extract_stream(tar_of(link, through), dest)
    assert not (tmp_path / "owned").exists()
    up = tarfile.TarInfo("../escaped")
    up.size = 1
    with pytest.raises(tarfile.TarError):
        extract_stream(tar_of(up), dest)
    assert not (tmp_path / "escaped").exists()
    assert extract_stream(io.BufferedReader(io.BytesIO(b"")), dest) == 0  # type: ignore[arg-type]


# ----- docker ----------------------------------------------------------------------------------------
VENV_TAG = "polar-test/venv-path:1"


@pytest.fixture
def venv_image(docker_host: str, tmp_path: Path) -> Iterator[str]:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello").write_text(HELLO)
    (ctx / "Dockerfile").write_text(f"FROM {DOCKER_IMAGE}\nCOPY hello /opt/venv/bin/hello\nRUN chmod 755 /opt/venv/bin/hello\n"
                                    f"ENV PATH={VENV_PATH}\n")
    proc = subprocess.run(["docker", "build", "-q", "-t", VENV_TAG, str(ctx)], capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode != 0:
        unavailable(f"docker build failed: {proc.stderr.strip()[-500:]}")
    yield VENV_TAG


async def test_docker_path_is_the_images(venv_image: str) -> None:
    from polar_env.harnesses.launch import DEFAULT_PATH

    rt = DockerRuntime(RuntimeSpec(kind="docker", image=venv_image, network="none", disk_mb=None))
    await rt.prepare()
    try:
        assert rt.path == VENV_PATH
        launch_path = ":".join(dict.fromkeys(["/opt/polar/node/bin", *rt.path.split(":")]))  # as run_harness builds it
        res = await rt.exec(["hello"], env={"PATH": launch_path, "HOME": "/root"})
        assert res.exit_code == 0 and "hello from the image venv" in res.output, res.output
        assert launch_path != DEFAULT_PATH
    finally:
        await rt.stop()
    own = DockerRuntime(RuntimeSpec(kind="docker", image=venv_image, env={"PATH": "/x:/bin"}))
    assert own.path == "/x:/bin"  # spec.env wins, before prepare too


async def test_docker_missing_image_is_one_line(docker_host: str) -> None:
    rt = DockerRuntime(RuntimeSpec(kind="docker", image="polar-test/absent:nope", network="none"))
    with pytest.raises(ConfigError) as exc:
        await rt.prepare()
    await rt.stop()
    line = str(exc.value)
    assert "\n" not in line and "`docker pull polar-test/absent:nope`" in line and "--pull" in line


def test_preflight_lists_every_missing_docker_image(docker_host: str, capsys: pytest.CaptureFixture[str]) -> None:
    images = ["polar-test/absent-a:1", DOCKER_IMAGE, "docker.io/x/absent-b:latest", "polar-test/absent-a:1"]
    with pytest.raises(ConfigError) as exc:
        preflight.check_runtime("docker", images=images)
    line = str(exc.value)
    assert "\n" not in line and line.startswith("2 docker image(s) not on the daemon")
    assert "polar-test/absent-a:1 (docker pull polar-test/absent-a:1)" in line
    assert "docker.io/x/absent-b:latest (docker pull docker.io/x/absent-b:latest)" in line
    assert DOCKER_IMAGE + " (" not in line
    preflight.check_runtime("docker", images=[DOCKER_IMAGE])  # present: no error


async def test_pull_is_once_per_image_under_concurrent_prepares() -> None:
    """With pull on, sessions preparing together pull a missing image once (a lock per image)."""
    import asyncio

    import docker

    from polar_env.runtimes.docker_image import ensure_image

    class Image:
        attrs = {"Config": {"Env": ["PATH=/opt/venv/bin:/bin", "NOEQ"]}}

    class Images:
        def __init__(self) -> None:
            self.present: set[str] = set()
            self.pulls: list[str] = []

        def get(self, name: str) -> Image:
            if name not in self.present:
                raise docker.errors.ImageNotFound(name)
            return Image()

        def pull(self, name: str) -> Image:
            time.sleep(0.05)
            self.pulls.append(name)
            self.present.add(name)
            return Image()

    class Client:
        images = Images()

    async def blocking(fn: object, *args: str) -> object:
        return await asyncio.to_thread(fn, *args)  # type: ignore[arg-type]

    client = Client()
    envs = await asyncio.gather(*(ensure_image(client, name, True, blocking, "unix://x")
                                  for name in ["a:1", "b:1", "a:1", "a:1", "b:1"]))
    assert sorted(client.images.pulls) == ["a:1", "b:1"]
    assert all(env == {"PATH": "/opt/venv/bin:/bin"} for env in envs)
    with pytest.raises(ConfigError, match=r"^docker image c:1 is not present locally \(the daemon at unix://x\), .*`docker pull c:1`"):
        await ensure_image(client, "c:1", False, blocking, "unix://x")
