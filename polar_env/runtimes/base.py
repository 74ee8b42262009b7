"""The Runtime seam: prepare (INIT work), exec, files, workspace diff, stop.

Every runtime gives the harness a writable workspace (``spec.workdir``, default ``/testbed``)
and a network that reaches the gateway and nothing else: the gateway's unix socket is bound into
the runtime and a relay inside listens on ``127.0.0.1:<gateway_port>``, so harness base URLs stay
plain ``http://127.0.0.1:<port>``. Start-up and teardown times are recorded in ``timings``.
To add a runtime: one module implementing ``Runtime`` (and its preflight check) plus one ``RUNTIMES.register``
line in ``kinds.py``.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from polar_env.registry import Registry


class RuntimeSpec(BaseModel):
    """How to build one runtime. Crosses process lines (TaskRequest), hence pydantic."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "sandbox"  # a RUNTIMES name (sandbox, docker, apptainer), checked here
    # docker: an image name; sandbox/apptainer: a rootfs or bundle folder (bundle.py) or an image name
    # in the local image store (polar-env images build/unpack fill it); apptainer: also .sif, docker://
    image: str | None = None
    pull: bool = False  # docker: pull a missing image at prepare (else it is refused in one line)
    workdir: str = "/testbed"
    source_dir: Path | None = None  # copied into workdir at prepare (a task repo)
    env: dict[str, str] = Field(default_factory=dict)
    gateway_socket: Path | None = None  # the gateway's unix socket, bridged to 127.0.0.1:gateway_port
    gateway_port: int = Field(default=8100, ge=1, le=65535)
    network: Literal["gateway", "none"] = "gateway"  # "gateway": loopback + the bridged gateway only
    # per-session limits (None: unlimited); see runtimes/limits.py for how each runtime enforces them
    pids_limit: int | None = Field(default=1024, ge=16)
    memory_mb: int | None = Field(default=4096, ge=64)
    disk_mb: int | None = Field(default=8192, ge=16)  # the writable trees (workspace, /tmp, HOME)
    output_mb: float = Field(default=8, gt=0)  # merged output kept per exec (head and tail; marker between)
    patch_mb: float = Field(default=32, gt=0)  # the agent's diff
    # rootless Apptainer where the host delegates no cgroup: run with memory and pids unbounded (the
    # limits report says so) instead of refusing at preflight and prepare (runtimes/apptainer.py)
    allow_unbounded: bool = False
    binds: list[tuple[Path, str]] = Field(default_factory=list)  # extra read-only binds (e.g. harness installs)
    # Docker: whose uid commands run as. "agent": an unprivileged uid that owns the workspace (the
    # agent's runtime). "root": container root, for grading runtimes only — SWE-bench eval scripts
    # re-run the repo's install into the image's root-owned environment. The bubblewrap sandbox
    # maps its root to an unprivileged host uid either way; Apptainer runs as the invoking user
    # (as root: the runtime's own unprivileged uid).
    user: Literal["agent", "root"] = "agent"
    # Docker: root inside for the agent where the daemon remaps uids (auto), demanded (require: a
    # one-line refusal where it does not), or never (off); see runtimes/docker_userns.py
    agent_root: Literal["auto", "require", "off"] = "auto"

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str, info: ValidationInfo) -> str:
        return RUNTIMES.check(value, info)


def check_host_paths(spec: RuntimeSpec) -> None:
    """Fail at prepare, clearly, when what the runtime must bind from the host is missing."""
    from polar_env.errors import ConfigError

    if spec.network == "gateway" and spec.gateway_socket is not None:
        sock = Path(spec.gateway_socket)
        if not sock.exists() or not stat.S_ISSOCK(sock.stat().st_mode):
            raise ConfigError(f"gateway socket {sock} does not exist (start the gateway with --unix-socket first)")
    for src, _dst in spec.binds:
        if not Path(src).exists():
            raise ConfigError(f"bind source {src} does not exist")


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    output: str  # stdout and stderr merged, in order (SWE-bench markers arrive on stderr)
    timed_out: bool
    duration_s: float
    limit: str | None = None  # the limit this exec (or its session) hit, e.g. "memory_mb=4096 exceeded (...)"
    truncated_bytes: int = 0  # output dropped by the output_mb cap


@dataclass(slots=True)
class Timings:
    prepare_s: float = 0.0
    stop_s: float = 0.0
    exec_s: list[float] = field(default_factory=list)


class Runtime(Protocol):
    name: str
    spec: RuntimeSpec
    timings: Timings

    @property
    def path(self) -> str:
        """The PATH a command gets when the caller passes none: spec.env's, else the image's, else the default."""
        ...

    async def prepare(self) -> None: ...

    async def exec(
        self, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 600.0
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def diff(self) -> str: ...

    async def stop(self) -> None: ...


@runtime_checkable
class Limited(Protocol):
    """A runtime that enforces the spec's limits (every registered kind; a test double may not):
    ``limit_hit``, the limit the session hit (sticky: the watchdog killed what was left)."""

    @property
    def limit_hit(self) -> str | None: ...


@runtime_checkable
class ReportsLimits(Protocol):
    """A runtime that says how each limit is enforced on this host (every registered kind): the
    session outcome's ``limits``."""

    def limits_report(self) -> dict[str, object]: ...


def limit_hit_of(runtime: object) -> str | None:
    """The limit ``runtime`` hit, or None: none hit, or it enforces none (``Limited``)."""
    hit = runtime.limit_hit if isinstance(runtime, Limited) else None
    return hit or None


def limits_report_of(runtime: object) -> dict[str, object]:
    """``runtime``'s limits report, or {} for one that reports none (``ReportsLimits``)."""
    return runtime.limits_report() if isinstance(runtime, ReportsLimits) else {}


@dataclass(frozen=True, slots=True)
class RuntimeNeeds:
    """What a job's sessions ask of one runtime kind, for its preflight check (``RUNTIMES`` entries'
    ``preflight``, called with one of these). ``image``: one the sessions use; ``agent_root``: the
    strictest any asks (Docker); ``images``: every image they need present, all missing ones named
    in one line; ``pulled``: those a session pulls at prepare itself; ``unbounded_ok``: no session
    needs memory/pids bounded (none asks, or all allow_unbounded)."""

    image: str | None = None
    agent_root: str = "auto"
    images: tuple[str, ...] = ()
    pulled: frozenset[str] = frozenset()
    unbounded_ok: bool = False

    @classmethod
    def of(cls, specs: list[RuntimeSpec]) -> RuntimeNeeds:
        roots = {s.agent_root for s in specs}
        return cls(image=next((s.image for s in specs if s.image), None),
                   agent_root=next((a for a in ("require", "auto") if a in roots), "off"),
                   images=tuple(s.image for s in specs if s.image),
                   pulled=frozenset(s.image for s in specs if s.image and s.pull),
                   unbounded_ok=all(s.allow_unbounded or (s.memory_mb is None and s.pids_limit is None) for s in specs))


async def prepared(runtime: Runtime) -> Runtime:
    """``runtime`` prepared; a failed or cancelled preparation stops what it started first."""
    try:
        await runtime.prepare()
    except BaseException:
        await runtime.stop()
        raise
    return runtime


# The table of runtime classes (each built as ``cls(spec, **options)``; params: RuntimeSpec; preflight:
# a function of ``RuntimeNeeds``, required), filled by ``polar_env/runtimes/kinds.py``; declared here
# so ``RuntimeSpec`` checks kinds without importing the modules that import it.
RUNTIMES: Registry[type[Any]] = Registry("runtime", preflight=True)
