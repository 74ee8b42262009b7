"""Docker runtime: one container per episode, through the ``docker`` Python SDK (``DOCKER_HOST`` honoured).

prepare:
- the image must already be present (``spec.image``; see ``polar_env.tasks.images``).
  Nothing is pulled unless ``spec.pull`` (``--pull``) or ``pull=True``, then once per image per
  process (``docker_image.py``); an absent image is a ConfigError naming ``docker pull``. Its
  ``Config.Env`` is read then: ``path`` is the image's ``ENV PATH`` unless ``spec.env`` sets one.
- the container runs an idle loop under ``--init`` with ``network_mode="none"`` (its own network
  namespace with only ``lo``), ``spec.memory_mb`` (swap off) and ``spec.pids_limit``, ``spec.env``
  as its environment (on top of the image's own, which matters: SWE images put conda on PATH),
  ``spec.binds`` read-only, and the gateway's unix socket bound at ``/run/polar/gw.sock``.
- ``spec.source_dir`` is copied into ``spec.workdir`` (``put_archive``, or on the host into the disk
  tmpfs); else the image's own workdir (a SWE image's ``/testbed``). Without ``.git`` in it, a
  baseline commit is made (as the agent) so ``diff`` has something to compare to.
- the relay (``relay.py``, copied in with ``put_archive``) is started **once per container**:
  ``python3 /run/polar/relay.py --background`` returns only after ``127.0.0.1:<gateway_port>`` is
  bound, and the relay lives until the container is removed. The image needs ``python3`` for this
  (SWE-bench/SWE-Gym images have one).

Users (``docker_userns.py`` decides). Where the daemon remaps uids (``--userns-remap``, rootless),
the agent is container root, as SWE-bench and SWE-Gym run it (its ``pip install`` into the image's
root-owned env works), and an unprivileged uid on the host; it keeps ``CAPS_ROOT_AGENT`` (file
ownership only: no KILL or SETUID, so the relay stays out of its reach), no derived image is built,
and with ``disk_mb`` the tmpfs is chowned to the host uid of container root. Elsewhere nothing the
agent runs is root (``spec.user="root"`` is for grading runtimes only: every
exec then runs as container root, with the same dropped capabilities, in a fresh network-less
container, as SWE-bench's own harness grades). The agent's uid is ``AGENT_UID`` (160000: above the range
the bubblewrap sandbox draws its per-runtime uids from; without dockerd's ``--userns-remap`` it is
that uid on the host too, never a real user's). Every exec names its user (``docker exec -u``):
- the agent's uid: every ``exec`` (harness, grading commands), ``diff``, ``read_file``, the baseline
  commit and ``write_file``'s ``mkdir`` — git runs the repo's own config (filters, hooks), so never as
  root; ``read_file`` is permission-checked like the agent (a planted symlink to a root-only file fails).
- ``RELAY_UID`` (65534, nobody): the relay, so the agent cannot kill it (``kill -9 -1`` stays inside
  its own uid) and it is not root; the gateway socket is made connectable for it (``chmod 0666``;
  the session key still gates every route).
- root, explicit and short: ``ROOT_SETUP`` (a passwd entry, ``chown -R`` of the workdir, ``HOME``
  (``/root``) and ``AGENT_DIRS`` to the agent, ``/tmp`` 1777), run **once per image, workdir and
  uid** in a build container and committed as a derived image (``polar-agent:<key>``, labelled
  ``polar_env.runtime=docker-agent-image``) that every session's container then runs: a ``chown -R``
  copies a SWE repo up into a container's layer (overlayfs without ``metacopy``; 17 s for a 44 MB,
  4,300-file tree on this machine), so it is paid once per node, not per session. Per container,
  root runs only the fallback disk watchdog's ``du`` (and ``mkdir`` for a ``write_file`` outside the agent's
  trees). The only long-lived root processes are pid 1 (``docker-init``) and its idle ``sleep``: the
  container itself is root's so that ``du`` keeps its capability (Docker clears a container's
  effective capabilities for every exec when its configured user is not root).
The container runs with ``no-new-privileges`` (setuid binaries do not escalate) and every capability
dropped but ``DAC_OVERRIDE`` (``du`` reads what the agent hides with ``chmod 000``); a non-root exec
holds none: its effective and permitted sets are empty.

exec: ``docker exec`` (the CLI, as an asyncio subprocess: no thread per running exec, output
streamed through the ``output_mb`` cap) of ``timeout -s KILL <t> /bin/sh -c 'exec "$@" 2>&1' sh
CMD...`` (coreutils ``timeout`` must exist in the image; checked at prepare), so stderr shares
stdout's pipe (output merged in order) and the whole process group is killed at the deadline. The
environment reaches ``docker exec`` as ``-e NAME`` with the values in the CLI's own environment,
never in argv. Without the CLI, the SDK's ``exec_run`` runs on the bounded executor instead. The
SDK's blocking calls (create, put_archive, remove) run on one bounded executor (``EXECUTOR``,
``POLAR_DOCKER_THREADS`` threads), never the default one. ``timed_out`` is set when
the exec ended by SIGKILL/124 at or after the deadline, and ``exit_code`` is then 124. A host-side
watchdog (deadline + 30 s) covers a hung daemon. ``setsid`` escapees live on until ``stop``. ``diff``
is git inside; ``read_file`` is ``cat`` inside; ``write_file`` is ``put_archive`` (it reaches bind
mounts). ``stop`` removes the container (force), then the disk tmpfs, and is idempotent.

Limits: ``pids_limit`` and ``memory_mb`` are Docker's own (``--pids-limit``, ``--memory`` with swap
off); an OOM kill or a refused fork inside is read from the container's cgroup on this host and ends
the session like in the other runtimes. ``disk_mb``, as root for the agent's runtime, is the kernel's:
a host tmpfs bind-mounted over all the agent can write (``docker_disk.py``: workdir, /tmp, HOME...). Else
(not root, ``POLAR_DISK_TMPFS=0``, the root grading runtime) only a watchdog (``DISK_MECHANISM``,
``du -x`` inside every ``DISK_CHECK_S``): it misses files deleted while held open and can be outrun
(``storage_opt`` needs xfs pquota). ``output_mb`` and ``patch_mb`` are the shared stream caps.

Containers carry the labels ``polar_env.runtime=docker`` and ``polar_env.owner`` (host, pid, start time):
after a crash, the next node's ``docker_leftovers.sweep`` removes them and bounds the derived images
(the tmpfs folders are ``leftovers.sweep``'s). Bind mounts name
host paths, so the daemon must run on this host (and mount namespace); the socket is bound by inode,
so the gateway must keep the same socket file for the container's lifetime.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import posixpath
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Self

from polar_env.errors import ConfigError
from polar_env.runtimes.argv import GATEWAY_SOCKET, POLAR_RUN_DIR, RELAY_PATH, RELAY_SOURCE, shell_argv
from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings, check_host_paths
from polar_env.runtimes.docker_disk import DockerDisk, disk_mechanism
from polar_env.runtimes.docker_image import DEFAULT_PATH, ensure_image
from polar_env.runtimes.docker_leftovers import AGENT_IMAGE_LABEL, LABEL, OWNER, owner
from polar_env.runtimes.docker_userns import Userns, agent_uid, docker_host, unix_daemon_problem, userns_of
from polar_env.runtimes.hostworkspace import BASELINE_SCRIPT, DIFF_SCRIPT, SANDBOX_UID_BASE, SANDBOX_UID_SLOTS, TIMEOUT_EXIT_CODE
from polar_env.runtimes.limits import MIB, CappedBuffer, Cgroup, LimitExceeded, patch_text, refuse_after_limit

log = logging.getLogger(__name__)

RELAY_UID = 65534  # nobody: the idle loop and the relay (not the agent, not root)
# Where the relay looks for python3 first when the task's env sets PATH: the image's system python,
# not one the task puts first (a venv bound from the host may be unreadable to the relay's uid).
RELAY_PATH_FIRST = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOME = "/root"  # the harness's $HOME in every runtime (harnesses/launch.py)
AGENT_DIRS = ("/logs", "/tests")  # created for the agent uid: Harbor's verifier writes /logs/verifier, /tests
CAPS_KEPT = ["DAC_OVERRIDE"]  # for du only; no non-root exec holds it
CAPS_ROOT_AGENT = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID"]  # root agent in a user namespace: its files only
AGENT_UID = SANDBOX_UID_BASE + SANDBOX_UID_SLOTS  # 160000: outside the sandbox's per-runtime range
_AGENT_IMAGES = threading.Lock()  # one build per derived image in this process
ROOT_SETUP = (
    "command -v timeout >/dev/null || {{ echo 'no timeout (coreutils)'; exit 3; }}; "
    "grep -q '^[^:]*:[^:]*:{uid}:' /etc/passwd 2>/dev/null || echo 'polar:x:{uid}:{uid}:polar agent:{home}:/bin/sh' >> /etc/passwd; "
    "grep -q '^[^:]*:[^:]*:{uid}:' /etc/group 2>/dev/null || echo 'polar:x:{uid}:' >> /etc/group; "
    "mkdir -p {dirs} /tmp && chmod 1777 /tmp && chown -R {uid}:{uid} {dirs} && chmod 700 {home}"
)
WATCHDOG_GRACE_S = 30.0
IDLE_LOOP = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done"]
DOCKER_INSTALL = "pip install 'docker>=7'"
DISK_CHECK_S = 5.0
DISK_MECHANISM = (f"watchdog (du -x inside, every {DISK_CHECK_S:g} s; workdir, /tmp, HOME in the container layer; "
                  "not a kernel bound: misses files deleted while open; storage_opt needs xfs pquota)")
LIMIT_EXIT_CODE = 137
EXECUTOR = ThreadPoolExecutor(max_workers=int(os.environ.get("POLAR_DOCKER_THREADS", "8")),
                              thread_name_prefix="polar-docker")


async def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """A blocking SDK call on the bounded Docker executor."""
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, fn, *args)


def _container_cgroup(container_id: str) -> Cgroup | None:
    """The container's cgroup on this host (cgroupfs v1, or v2 under docker/ or system.slice)."""
    root = Path("/sys/fs/cgroup")
    v1 = (root / "memory" / "docker" / container_id, root / "pids" / "docker" / container_id)
    if v1[0].is_dir():
        group = Cgroup("v1", list(v1), [], memory_events=v1[0] / "memory.oom_control", pids_events=v1[1] / "pids.events")
    else:
        d = next((c for c in (root / "docker" / container_id, root / "system.slice" / f"docker-{container_id}.scope")
                  if c.is_dir()), None)
        if d is None:
            return None
        group = Cgroup("v2", [d], [], memory_events=d / "memory.events", pids_events=d / "pids.events")
    group.baseline = group.counters()
    return group


def timeout_argv(argv: list[str], timeout_s: float) -> list[str]:
    """Run ``argv`` with stderr merged into stdout, killed (whole process group) at ``timeout_s``."""
    return ["timeout", "-s", "KILL", f"{max(timeout_s, 0.001):.3f}", "/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]


def _tar_dir(src: Path, uid: int) -> tempfile.SpooledTemporaryFile[bytes]:
    if not src.is_dir():
        raise ConfigError(f"source_dir {src} is not a directory")

    def as_agent(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = uid
        info.uname = info.gname = ""
        return info

    buf = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 - returned to the caller
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in sorted(os.listdir(src)):
            tar.add(src / entry, arcname=entry, recursive=True, filter=as_agent)
    buf.seek(0)
    return buf


def _tar_file(name: str, data: bytes, mode: int = 0o644, uid: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = mode
        info.uid = info.gid = uid
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerRuntime:
    """One container per episode; see the module docstring."""

    name: ClassVar[str] = "docker"

    def __init__(self, spec: RuntimeSpec, *, pull: bool = False, client: Any = None, init: bool = True,
                 root_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.timings = Timings()
        self._pull = pull or spec.pull
        self._image_env: dict[str, str] = {}  # the image's Config.Env, read at prepare
        self._client = client
        self._own_client = client is None
        self._init = init
        self._container: Any = None
        self._stopped = False
        self._cli = shutil.which("docker")
        self._cgroup: Cgroup | None = None
        self.limit_hit: str | None = None
        self._last_disk = 0.0
        self.uid = AGENT_UID if spec.user == "agent" else 0
        self._ns = Userns(False, None, "dockerd userns state unknown")
        self._who = ""  # why self.uid is what it is (docker_userns.agent_uid)
        self._root_dir = root_dir  # the node's incarnation folder: the tmpfs's host dir goes there
        self._disk: DockerDisk | None = None  # the tmpfs, or why there is none:
        self._no_disk: str | None = None
        self._disk_task: asyncio.Task[None] | None = None

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

    @property
    def path(self) -> str:
        """The PATH a command gets when the caller passes none: spec.env's, else the image's, else the default."""
        return self.spec.env.get("PATH") or self._image_env.get("PATH") or DEFAULT_PATH

    def _agent_image(self, client: Any) -> str:
        """``spec.image`` with ``ROOT_SETUP`` applied, built once and committed (see the module doc)."""
        import docker

        base = client.images.get(self.spec.image)
        workdir = posixpath.normpath(self.spec.workdir)
        dirs = " ".join(shlex.quote(d) for d in dict.fromkeys([workdir, HOME, *AGENT_DIRS]))
        script = ROOT_SETUP.format(uid=self.uid, home=HOME, dirs=dirs)
        key = hashlib.sha256(f"{base.id}\0{script}".encode()).hexdigest()[:20]
        tag = f"polar-agent:{key}"
        with _AGENT_IMAGES:
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.get(tag)
                return tag
            build = client.containers.run(base.id, entrypoint=["/bin/sh", "-c"], command=[script], user="0:0",
                                          network_mode="none", detach=True, labels={LABEL: AGENT_IMAGE_LABEL, OWNER: owner()})
            try:
                code = build.wait(timeout=1800).get("StatusCode")
                if code == 3:
                    raise ConfigError(f"docker image {self.spec.image} has no `timeout` (coreutils); exec needs it")
                if code != 0:
                    logs = build.logs().decode("utf-8", "replace").strip()[-2000:]
                    raise ConfigError(f"docker: cannot hand {dirs} to the agent's uid {self.uid} in {self.spec.image}: {logs}")
                build.commit(repository="polar-agent", tag=key, conf={"Labels": {LABEL: AGENT_IMAGE_LABEL}})
            finally:
                build.remove(force=True)
        log.info("docker: built %s from %s (agent uid %d owns %s)", tag, self.spec.image, self.uid, dirs)
        return tag

    def _create(self) -> None:
        client = self._client if self._client is not None else self._connect()
        self._client = client
        self._ns = userns_of(client, docker_host())
        self.uid, self._who = agent_uid(self.spec.user, self.spec.agent_root, self._ns, AGENT_UID)
        image: str = self._agent_image(client) if self.uid != 0 else self.spec.image or ""  # root: no ownership to hand over
        volumes: dict[str, dict[str, str]] = {}
        if self.spec.network == "gateway" and self.spec.gateway_socket is not None:
            volumes[str(Path(self.spec.gateway_socket).resolve())] = {"bind": GATEWAY_SOCKET, "mode": "rw"}
        for src, dst in self.spec.binds:
            volumes[str(Path(src).resolve())] = {"bind": dst, "mode": "ro"}
        self._disk, self._no_disk = DockerDisk.setup(self.spec, self._ns.host_uid(self.uid), (HOME, *AGENT_DIRS), self._root_dir,
                                                     client, image, self._ns.line)
        volumes.update(self._disk.volumes() if self._disk is not None else {})
        kwargs: dict[str, Any] = {}
        if self.spec.memory_mb is not None:
            kwargs["mem_limit"] = f"{self.spec.memory_mb}m"
            kwargs["memswap_limit"] = f"{self.spec.memory_mb}m"
        if self.spec.pids_limit is not None:
            kwargs["pids_limit"] = self.spec.pids_limit
        self._container = client.containers.run(
            image,
            entrypoint=IDLE_LOOP[:1],
            command=IDLE_LOOP[1:],
            name=f"polar-{uuid.uuid4().hex[:12]}",
            hostname="sandbox",
            detach=True,
            init=self._init,
            network_mode="none",
            user="0:0",  # only docker-init and its idle sleep; a non-root exec holds no capability
            cap_drop=["ALL"],
            cap_add=self._caps(),
            security_opt=["no-new-privileges"],
            environment={"HOME": HOME, **self.spec.env},
            volumes=volumes,
            working_dir=self.spec.workdir,
            labels={LABEL: self.name, OWNER: owner()},
            **kwargs,
        )

    def _caps(self) -> list[str]:
        return CAPS_ROOT_AGENT if self.uid == 0 and self.spec.user == "agent" else CAPS_KEPT

    def _put_workspace(self) -> None:
        with _tar_dir(Path(str(self.spec.source_dir)), self.uid) as data:
            self._container.put_archive(self.spec.workdir, data)

    def _open_socket(self) -> None:
        """The relay connects as ``RELAY_UID``; the session key, not the mode, gates the gateway."""
        with contextlib.suppress(OSError):
            assert self.spec.gateway_socket is not None
            os.chmod(self.spec.gateway_socket, 0o666)

    async def prepare(self) -> None:
        if self._container is not None or self._stopped:
            raise ConfigError("docker runtime already prepared")
        start = time.monotonic()
        if not self.spec.workdir.startswith("/"):
            raise ConfigError(f"workdir must be absolute, got {self.spec.workdir!r}")
        check_host_paths(self.spec)
        if not self.spec.image:
            raise ConfigError("the docker runtime needs spec.image")
        try:
            self._client = await _blocking(self._connect)
            self._image_env = await ensure_image(self._client, self.spec.image, self._pull, _blocking, docker_host())
            await _blocking(self._create)
            self._cgroup = _container_cgroup(self._live().id)
            if self.spec.source_dir is not None and self._disk is None:  # the tmpfs was populated on the host
                await _blocking(self._put_workspace)
            if self.spec.network == "gateway" and self.spec.gateway_socket is not None:
                await _blocking(self._open_socket)
                await _blocking(
                    self._live().put_archive, POLAR_RUN_DIR, _tar_file(posixpath.basename(RELAY_PATH), RELAY_SOURCE.read_bytes())
                )
                code, out, _ = await self._exec_raw(
                    [
                        "python3", RELAY_PATH, "--listen", f"127.0.0.1:{self.spec.gateway_port}",
                        "--socket", GATEWAY_SOCKET, "--background",
                    ],
                    self._relay_env(), "/", demux=False, user=f"{RELAY_UID}:{RELAY_UID}",
                )  # fmt: skip
                if code != 0:
                    text = out.text().strip()
                    raise ConfigError(f"docker: the gateway relay does not start in {self.spec.image} (needs python3): {text}")
            res = await self.exec(BASELINE_SCRIPT, timeout_s=120)
            if res.exit_code != 0:
                log.warning("docker: no git baseline in %s (diff() will fail): %s", self.spec.workdir, res.output.strip())
            if self._disk is not None:
                self._disk_task = asyncio.create_task(self._disk.watch(lambda: self.limit_hit, self._trip))
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
        if self._disk_task is not None:
            self._disk_task.cancel()
            await asyncio.gather(self._disk_task, return_exceptions=True)

        def remove() -> None:
            import docker

            try:
                if container is not None:
                    with contextlib.suppress(docker.errors.NotFound):
                        container.remove(force=True)
                if self._own_client and self._client is not None:
                    self._client.close()
            finally:
                if self._disk is not None:  # after the container: its binds are gone; never raises
                    self._disk.remove()

        await _blocking(remove)

    # ----- exec --------------------------------------------------------------------------------
    def _live(self) -> Any:
        if self._container is None:
            raise ConfigError("docker runtime is not prepared (or already stopped)")
        return self._container

    def _relay_env(self) -> dict[str, str] | None:
        """The relay's PATH: the system's first when the task sets its own, else the image's as is."""
        task_path = self.spec.env.get("PATH")
        return None if task_path is None else {"PATH": f"{RELAY_PATH_FIRST}:{task_path}"}

    async def _exec_raw(
        self, argv: list[str], env: dict[str, str] | None, cwd: str | None, *, demux: bool,
        watchdog_s: float | None = None, cap: int | None = None, user: str | None = None,
    ) -> tuple[int, CappedBuffer, CappedBuffer]:
        """(exit code, stdout, stderr) — without ``demux`` both streams are in stdout and stderr is
        empty — each capped at ``cap`` bytes; streams from ``docker exec`` without holding a thread. ``user``
        defaults to the agent's uid (see the module doc for who runs what)."""
        container = self._live()
        user = user or f"{self.uid}:{self.uid}"
        cap = cap if cap is not None else int(self.spec.output_mb * MIB)
        out, err = CappedBuffer(cap), CappedBuffer(cap, what="stderr")
        if self._cli is None:  # no CLI: the SDK on the bounded executor (output arrives whole)
            def run() -> tuple[int, Any]:
                res = container.exec_run(argv, environment=env or None, workdir=cwd or self.spec.workdir, demux=demux,
                                         user=user)
                return res.exit_code, res.output

            fut = _blocking(run)
            code, raw = await (asyncio.wait_for(fut, watchdog_s) if watchdog_s is not None else fut)
            if demux:
                out.add(raw[0] or b"")
                err.add(raw[1] or b"")
            else:
                out.add(raw or b"")
            return code, out, err
        names = sorted(env or {})
        cli = [self._cli, "exec", "-u", user, "-w", cwd or self.spec.workdir, *(x for n in names for x in ("-e", n)), container.id, *argv]
        proc = await asyncio.create_subprocess_exec(
            *cli, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {}), "DOCKER_HOST": docker_host()}, start_new_session=True)

        async def drain(stream: asyncio.StreamReader | None, into: CappedBuffer) -> None:
            while stream is not None and (chunk := await stream.read(65536)):
                into.add(chunk)

        readers = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err if demux else out))
        try:
            code = await (asyncio.wait_for(proc.wait(), watchdog_s) if watchdog_s is not None else proc.wait())
            await asyncio.wait_for(readers, 10)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            readers.cancel()
        return code, out, err

    async def exec(
        self, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 600.0
    ) -> ExecResult:
        if self.limit_hit is not None:
            return ExecResult(LIMIT_EXIT_CODE, f"[polar_env: {self.limit_hit}]", False, 0.0, limit=self.limit_hit)
        argv = timeout_argv(shell_argv(command), timeout_s)
        start = time.monotonic()
        truncated = 0
        try:
            code, buf, _ = await self._exec_raw(argv, env, cwd, demux=False, watchdog_s=timeout_s + WATCHDOG_GRACE_S)
            text, truncated = buf.text(), max(buf.truncated, 0)
        except TimeoutError:
            code, text = TIMEOUT_EXIT_CODE, "[polar_env: docker exec did not return; watchdog fired]\n"
        duration = time.monotonic() - start
        timed_out = code in (TIMEOUT_EXIT_CODE, 137, -9) and duration >= timeout_s
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        self.timings.exec_s.append(duration)
        hit = await self._check_limits()
        return ExecResult(LIMIT_EXIT_CODE if hit else code, text, timed_out, duration, limit=hit, truncated_bytes=truncated)

    async def _check_limits(self) -> str | None:
        if self.limit_hit is None and self._cgroup is not None and (which := self._cgroup.hit()) is not None:
            why = "OOM kill" if which == "memory_mb" else "fork refused"
            await self._trip(which, f"docker --{'memory' if which == 'memory_mb' else 'pids-limit'} (cgroup)", why)
        if self.limit_hit is None and self._disk is not None and (full := self._disk.full()) is not None:
            await self._trip("disk_mb", self._disk.mechanism, full)
        if (self.limit_hit is None and self.spec.disk_mb is not None and self._container is not None
                and self._disk is None and time.monotonic() - self._last_disk >= DISK_CHECK_S):
            self._last_disk = time.monotonic()
            dirs = sorted({self.spec.workdir, "/tmp", "/root"})
            code, du_out, _ = await self._exec_raw(["du", "-skxc", *dirs], None, "/", demux=True, cap=MIB, user="0:0")
            lines = du_out.text().split()
            used_kib = int(lines[-2]) if code in (0, 1) and len(lines) >= 2 and lines[-2].isdigit() else 0
            if used_kib * 1024 > self.spec.disk_mb * MIB:
                await self._trip("disk_mb", f"{DISK_MECHANISM}; no tmpfs: {self._no_disk}", f"{used_kib // 1024} MiB written")
        return self.limit_hit

    async def _trip(self, limit: str, mechanism: str, why: str) -> None:
        self.limit_hit = f"{limit}={getattr(self.spec, limit)} ({mechanism}): {why}"
        log.warning("docker runtime: %s; killing the container", self.limit_hit)
        container = self._container
        if container is not None:
            with contextlib.suppress(Exception):
                await _blocking(container.kill)

    def limits_report(self) -> dict[str, Any]:
        spec = self.spec
        return {"uid": f"{self.uid} in container; {self._ns.line}; {self._who}",
                "privileges": f"no-new-privileges; capabilities: {', '.join(self._caps())} (root execs only); "
                              f"relay as uid {RELAY_UID}",
                "limits": {k: getattr(spec, k) for k in ("pids_limit", "memory_mb", "disk_mb", "output_mb", "patch_mb")},
                "mechanisms": {"pids_limit": "docker --pids-limit (cgroup)" if spec.pids_limit else "none",
                               "memory_mb": "docker --memory, swap off (cgroup)" if spec.memory_mb else "none",
                               "disk_mb": disk_mechanism(self._disk, self.spec.disk_mb, f"{DISK_MECHANISM}; no tmpfs: {self._no_disk}"),
                               "output_mb": "stream cap on docker exec", "patch_mb": "stream cap on diff()"},
                "hit": self.limit_hit}

    # ----- files and diff ----------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes) -> None:
        if not path.startswith("/"):
            raise ConfigError(f"runtime paths must be absolute, got {path!r}")
        path = posixpath.normpath(path)
        parent, name = posixpath.split(path)
        code, out, _ = await self._exec_raw(["mkdir", "-p", "--", parent or "/"], None, "/", demux=False)
        if code != 0:  # outside the agent's trees: root makes the directory, the file is still the agent's
            code, out, _ = await self._exec_raw(["mkdir", "-p", "--", parent or "/"], None, "/", demux=False, user="0:0")
        if code != 0:
            raise ConfigError(f"docker: cannot create {parent}: {out.text().strip()}")
        container = self._live()

        def put() -> None:
            import docker

            try:
                ok = container.put_archive(parent or "/", _tar_file(name, data, uid=self.uid))
            except docker.errors.APIError as e:
                raise ConfigError(f"docker: cannot write {path}: {e}") from e
            if not ok:
                raise ConfigError(f"docker: cannot write {path}")

        await _blocking(put)

    async def read_file(self, path: str) -> bytes:
        if not path.startswith("/"):
            raise ConfigError(f"runtime paths must be absolute, got {path!r}")
        code, out, err = await self._exec_raw(["cat", "--", path], None, "/", demux=True, cap=int(self.spec.patch_mb * MIB))
        if code != 0:
            msg = err.text().strip()
            if "No such file" in msg:
                raise FileNotFoundError(path)
            raise ConfigError(f"docker: cannot read {path}: {msg}")
        if out.truncated > 0:
            raise LimitExceeded("patch_mb", f"{path} is over {self.spec.patch_mb:g} MiB")
        return out.data()

    async def diff(self) -> str:
        argv = ["timeout", "-s", "KILL", "300", "/bin/sh", "-c", DIFF_SCRIPT]  # stdout alone: the patch
        refuse_after_limit(self.limit_hit)
        code, out, err = await self._exec_raw(argv, None, None, demux=True, cap=int(self.spec.patch_mb * MIB))
        return patch_text("docker", self.spec.workdir, self.spec.patch_mb, code, out, err)

    async def __aenter__(self) -> Self:
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
