"""Docker runtime: one container per episode, through the ``docker`` Python SDK (``DOCKER_HOST`` honoured).

prepare:
- the image must already be present (``spec.image``; see ``polar_env.tasks.images``).
  Nothing is pulled unless the runtime was built with ``pull=True``; an absent image is a
  ConfigError naming it.
- the container runs an idle loop under ``--init`` with ``network_mode="none"`` (its own network
  namespace with only ``lo``), ``spec.memory_mb`` (swap off) and ``spec.pids_limit``, ``spec.env``
  as its environment (on top of the image's own, which matters: SWE images put conda on PATH),
  ``spec.binds`` read-only, and the gateway's unix socket bound at ``/run/polar/gw.sock``.
- ``spec.source_dir`` is copied into ``spec.workdir`` with ``put_archive`` (files owned by root);
  without it the image's own ``spec.workdir`` (e.g. a SWE image's ``/testbed``) is used as is. If
  the workspace has no ``.git``, a baseline commit is made so ``diff`` has something to compare to.
- the relay (``relay.py``, copied in with ``put_archive``) is started **once per container**:
  ``python3 /run/polar/relay.py --background`` returns only after ``127.0.0.1:<gateway_port>`` is
  bound, and the relay lives until the container is removed. The image needs ``python3`` for this
  (SWE-bench/SWE-Gym images have one).

exec: ``exec_run`` of ``timeout -s KILL <t> /bin/sh -c 'exec "$@" 2>&1' sh CMD...`` (coreutils
``timeout`` must exist in the image; checked at prepare), so stderr shares stdout's pipe (output
merged in order) and the whole process group is killed at the deadline. ``timed_out`` is set when
the exec ended by SIGKILL/124 at or after the deadline, and ``exit_code`` is then 124. A host-side
watchdog (deadline + 30 s) covers a hung daemon. Processes that escaped the group with ``setsid``
live on until ``stop``. ``diff`` runs git inside the container; ``read_file`` is ``cat`` inside;
``write_file`` is ``put_archive``. ``stop`` removes the container (force) and is idempotent.

Containers carry the label ``polar_env.runtime=docker``; after a crash, leftovers can be removed with
``docker rm -f $(docker ps -aq --filter label=polar_env.runtime)``. Bind mounts (gateway socket,
``spec.binds``) name host paths, so the daemon must run on this host; the socket is bound by inode,
so the gateway must keep the same socket file for the container's lifetime.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import posixpath
import socket
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar, Self

from polar_env.errors import ConfigError
from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings, check_host_paths
from polar_env.runtimes.sandbox import (
    BASELINE_SCRIPT,
    DIFF_SCRIPT,
    GATEWAY_SOCKET,
    POLAR_RUN_DIR,
    RELAY_PATH,
    RELAY_SOURCE,
    TIMEOUT_EXIT_CODE,
    shell_argv,
)

log = logging.getLogger(__name__)

LABEL = "polar_env.runtime"
WATCHDOG_GRACE_S = 30.0
IDLE_LOOP = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done"]
DOCKER_INSTALL = "pip install 'docker>=7'"


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def unix_daemon_problem(host: str | None = None) -> str | None:
    """For a ``unix://`` DOCKER_HOST, why nothing answers there (None when a connect succeeds).
    Checked with our own socket first: the SDK leaks its socket when the connect fails."""
    host = host or docker_host()
    if not host.startswith("unix://"):
        return None
    path = host[len("unix://") :]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    finally:
        s.close()
    return None


def timeout_argv(argv: list[str], timeout_s: float) -> list[str]:
    """Run ``argv`` with stderr merged into stdout, killed (whole process group) at ``timeout_s``."""
    return ["timeout", "-s", "KILL", f"{max(timeout_s, 0.001):.3f}", "/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]


def _tar_dir(src: Path) -> tempfile.SpooledTemporaryFile[bytes]:
    if not src.is_dir():
        raise ConfigError(f"source_dir {src} is not a directory")

    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 - returned to the caller
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in sorted(os.listdir(src)):
            tar.add(src / entry, arcname=entry, recursive=True, filter=as_root)
    buf.seek(0)
    return buf


def _tar_file(name: str, data: bytes, mode: int = 0o644) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = mode
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerRuntime:
    """One container per episode; see the module docstring."""

    name: ClassVar[str] = "docker"

    def __init__(self, spec: RuntimeSpec, *, pull: bool = False, client: Any = None, init: bool = True) -> None:
        self.spec = spec
        self.timings = Timings()
        self._pull = pull
        self._client = client
        self._own_client = client is None
        self._init = init
        self._container: Any = None
        self._stopped = False

    # ----- lifecycle ---------------------------------------------------------------------------
    def _connect(self) -> Any:
        try:
            import docker
        except ImportError as e:
            raise ConfigError(f"the docker runtime needs the docker SDK: {DOCKER_INSTALL}") from e
        where = docker_host()
        hint = "start one with scripts/start_dockerd.sh and export the DOCKER_HOST it prints"
        if self._client is None and (problem := unix_daemon_problem(where)) is not None:
            raise ConfigError(f"no Docker daemon answers at {where} ({problem}); {hint}")
        try:
            client = self._client or docker.from_env()
            client.ping()
        except docker.errors.DockerException as e:
            raise ConfigError(f"no Docker daemon answers at {where} ({e}); {hint}") from e
        return client

    def _ensure_image(self, client: Any) -> None:
        import docker

        image = self.spec.image
        if not image:
            raise ConfigError("the docker runtime needs spec.image")
        try:
            client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            if not self._pull:
                raise ConfigError(
                    f"docker image {image} is not present locally and pulling is off; "
                    f"`docker pull {image}` (or docker import/load it), or build the runtime with pull=True"
                ) from None
        log.info("pulling %s", image)
        client.images.pull(image)

    def _create(self) -> None:
        client = self._connect()
        self._client = client
        self._ensure_image(client)
        volumes: dict[str, dict[str, str]] = {}
        if self.spec.network == "gateway" and self.spec.gateway_socket is not None:
            volumes[str(Path(self.spec.gateway_socket).resolve())] = {"bind": GATEWAY_SOCKET, "mode": "rw"}
        for src, dst in self.spec.binds:
            volumes[str(Path(src).resolve())] = {"bind": dst, "mode": "ro"}
        kwargs: dict[str, Any] = {}
        if self.spec.memory_mb is not None:
            kwargs["mem_limit"] = f"{self.spec.memory_mb}m"
            kwargs["memswap_limit"] = f"{self.spec.memory_mb}m"
        if self.spec.pids_limit is not None:
            kwargs["pids_limit"] = self.spec.pids_limit
        self._container = client.containers.run(
            self.spec.image,
            entrypoint=IDLE_LOOP[:1],
            command=IDLE_LOOP[1:],
            name=f"polar-{uuid.uuid4().hex[:12]}",
            hostname="sandbox",
            detach=True,
            init=self._init,
            network_mode="none",
            environment=dict(self.spec.env),
            volumes=volumes,
            working_dir=self.spec.workdir,
            labels={LABEL: self.name},
            **kwargs,
        )

    def _put_workspace(self) -> None:
        assert self.spec.source_dir is not None
        with _tar_dir(Path(self.spec.source_dir)) as data:
            self._container.put_archive(self.spec.workdir, data)

    async def prepare(self) -> None:
        if self._container is not None or self._stopped:
            raise ConfigError("docker runtime already prepared")
        start = time.monotonic()
        if not self.spec.workdir.startswith("/"):
            raise ConfigError(f"workdir must be absolute, got {self.spec.workdir!r}")
        check_host_paths(self.spec)
        try:
            await asyncio.to_thread(self._create)
            probe = await self._exec_raw(["/bin/sh", "-c", "command -v timeout"], None, None, demux=True)
            if probe[0] != 0:
                raise ConfigError(f"docker image {self.spec.image} has no `timeout` (coreutils); exec needs it")
            if self.spec.source_dir is not None:
                await asyncio.to_thread(self._put_workspace)
            if self.spec.network == "gateway" and self.spec.gateway_socket is not None:
                await asyncio.to_thread(
                    self._container.put_archive, POLAR_RUN_DIR, _tar_file(posixpath.basename(RELAY_PATH), RELAY_SOURCE.read_bytes())
                )
                code, out = await self._exec_raw(
                    [
                        "python3", RELAY_PATH, "--listen", f"127.0.0.1:{self.spec.gateway_port}",
                        "--socket", GATEWAY_SOCKET, "--background",
                    ],
                    None, None, demux=False,
                )  # fmt: skip
                if code != 0:
                    text = out.decode("utf-8", "replace").strip()
                    raise ConfigError(f"docker: the gateway relay does not start in {self.spec.image} (needs python3): {text}")
            res = await self.exec(BASELINE_SCRIPT, timeout_s=120)
            if res.exit_code != 0:
                log.warning("docker: no git baseline in %s (diff() will fail): %s", self.spec.workdir, res.output.strip())
        except BaseException:
            await self._remove()
            raise
        self.timings.exec_s.clear()
        self.timings.prepare_s = time.monotonic() - start

    async def stop(self) -> None:
        if self._stopped:
            return
        start = time.monotonic()
        had = self._container is not None
        await self._remove()
        if had:
            self.timings.stop_s = time.monotonic() - start

    async def _remove(self) -> None:
        self._stopped = True
        container, self._container = self._container, None

        def remove() -> None:
            import docker

            if container is not None:
                try:
                    container.remove(force=True)
                except docker.errors.NotFound:
                    pass
            if self._own_client and self._client is not None:
                self._client.close()

        await asyncio.to_thread(remove)

    # ----- exec --------------------------------------------------------------------------------
    def _live(self) -> Any:
        if self._container is None:
            raise ConfigError("docker runtime is not prepared (or already stopped)")
        return self._container

    async def _exec_raw(
        self, argv: list[str], env: dict[str, str] | None, cwd: str | None, *, demux: bool, watchdog_s: float | None = None
    ) -> tuple[int, Any]:
        container = self._live()

        def run() -> tuple[int, Any]:
            res = container.exec_run(argv, environment=env or None, workdir=cwd or self.spec.workdir, demux=demux)
            return res.exit_code, res.output

        if watchdog_s is None:
            return await asyncio.to_thread(run)
        return await asyncio.wait_for(asyncio.to_thread(run), watchdog_s)

    async def exec(
        self, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 600.0
    ) -> ExecResult:
        argv = timeout_argv(shell_argv(command), timeout_s)
        start = time.monotonic()
        try:
            code, out = await self._exec_raw(argv, env, cwd, demux=False, watchdog_s=timeout_s + WATCHDOG_GRACE_S)
        except TimeoutError:
            code, out = TIMEOUT_EXIT_CODE, b"[polar_env: docker exec did not return; watchdog fired]\n"
        duration = time.monotonic() - start
        timed_out = code in (TIMEOUT_EXIT_CODE, 137, -9) and duration >= timeout_s
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        self.timings.exec_s.append(duration)
        return ExecResult(code, (out or b"").decode("utf-8", "replace"), timed_out, duration)

    # ----- files and diff ----------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes) -> None:
        if not path.startswith("/"):
            raise ConfigError(f"runtime paths must be absolute, got {path!r}")
        path = posixpath.normpath(path)
        parent, name = posixpath.split(path)
        code, out = await self._exec_raw(["mkdir", "-p", "--", parent or "/"], None, "/", demux=False)
        if code != 0:
            raise ConfigError(f"docker: cannot create {parent}: {out.decode('utf-8', 'replace').strip()}")
        container = self._live()

        def put() -> None:
            import docker

            try:
                ok = container.put_archive(parent or "/", _tar_file(name, data))
            except docker.errors.APIError as e:
                raise ConfigError(f"docker: cannot write {path}: {e}") from e
            if not ok:
                raise ConfigError(f"docker: cannot write {path}")

        await asyncio.to_thread(put)

    async def read_file(self, path: str) -> bytes:
        if not path.startswith("/"):
            raise ConfigError(f"runtime paths must be absolute, got {path!r}")
        code, (out, err) = await self._exec_raw(["cat", "--", path], None, "/", demux=True)
        if code != 0:
            msg = (err or b"").decode("utf-8", "replace").strip()
            if "No such file" in msg:
                raise FileNotFoundError(path)
            raise ConfigError(f"docker: cannot read {path}: {msg}")
        return out or b""

    async def diff(self) -> str:
        argv = ["timeout", "-s", "KILL", "300", "/bin/sh", "-c", DIFF_SCRIPT]  # stdout alone: the patch
        code, (out, err) = await self._exec_raw(argv, None, None, demux=True)
        if code != 0:
            msg = (err or b"").decode("utf-8", "replace").strip()
            raise ConfigError(f"docker: git diff failed in {self.spec.workdir} (exit {code}): {msg}")
        return (out or b"").decode("utf-8", "replace")

    async def __aenter__(self) -> Self:
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
