"""Test doubles and fixtures for evaluator tests.

``LocalRuntime`` is a TEST DOUBLE of the Runtime protocol: it runs commands with subprocess on this
machine, in a temp directory standing in for ``spec.workdir`` (``/testbed``). It isolates nothing;
it exists so evaluators can be tested where no sandbox is available. ``/tmp`` is the host's own (the
grader stages its files there); other paths outside the workdir are refused rather than silently
touching the host, and the workdir's name in commands and environment values points at the stand-in.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path, PurePosixPath

import pytest

from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings
from polar_env.tasks.swe import SweTask
from polar_env.tasks.toy import toy_tasks


class LocalRuntime:
    """TEST DOUBLE: subprocess in a temp dir standing in for /testbed. No isolation."""

    name = "local-test-double"

    def __init__(self, spec: RuntimeSpec | None = None, *, source_dir: Path | None = None) -> None:
        self.spec = spec if spec is not None else RuntimeSpec(source_dir=source_dir)
        self.timings = Timings()
        self.root: Path | None = None
        self.prepared = False
        self.stopped = False

    @property
    def workdir(self) -> Path:
        assert self.root is not None, "prepare() first"
        return self.root / "workdir"

    async def prepare(self) -> None:
        started = time.monotonic()
        self.root = Path(tempfile.mkdtemp(prefix="polar-localrt-"))
        if self.spec.source_dir is not None:
            await asyncio.to_thread(shutil.copytree, self.spec.source_dir, self.workdir, symlinks=True)
        else:
            self.workdir.mkdir()
        self.prepared = True
        self.timings.prepare_s = time.monotonic() - started

    def host_path(self, path: str) -> Path:
        p = PurePosixPath(path)
        if not p.is_absolute():
            raise ValueError(f"runtime paths must be absolute, got {path!r}")  # as the real runtimes
        if p == PurePosixPath("/") or p.is_relative_to("/tmp"):
            return Path(p)
        try:
            return self.workdir / p.relative_to(self.spec.workdir)
        except ValueError:
            raise ValueError(f"{path} is outside {self.spec.workdir} and /tmp, the only places this test double has") from None

    def _local(self, text: str) -> str:
        return re.sub(rf"{re.escape(self.spec.workdir)}(?=/|\s|$)", str(self.workdir), text)

    async def exec(
        self,
        command: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 600.0,
    ) -> ExecResult:
        started = time.monotonic()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)  # as the real runtimes
        argv = [self._local(a) for a in argv]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.host_path(cwd or self.spec.workdir),
            # paths under spec.workdir in the env (e.g. PYTEST_ADDOPTS' --rootdir) point at the stand-in
            # the test process's environment minus pytest's own (an xdist worker's PYTEST_XDIST_WORKER
            # would switch the graded run's grader plugin off), as the real runtimes clear it
            env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **self.spec.env,
                 **{k: self._local(v) for k, v in (env or {}).items()}},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # own process group, so a timeout kills the whole tree
        )
        assert proc.stdout is not None
        reader = asyncio.ensure_future(proc.stdout.read())
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # also on cancellation; and reaps stragglers holding stdout open
            await proc.wait()
        output = (await reader).decode("utf-8", errors="replace")
        duration = time.monotonic() - started
        self.timings.exec_s.append(duration)
        return ExecResult(
            exit_code=proc.returncode if proc.returncode is not None else -1,
            output=output,
            timed_out=timed_out,
            duration_s=duration,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def read_file(self, path: str) -> bytes:
        return self.host_path(path).read_bytes()

    async def diff(self) -> str:
        # a private index, so taking the diff does not stage anything in the workspace
        assert self.root is not None
        index = self.root / "diff-index"
        res = await self.exec(
            "git add -A && git diff --cached --binary HEAD",
            env={"GIT_INDEX_FILE": str(index), "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"},
        )
        index.unlink(missing_ok=True)
        if res.exit_code != 0:
            raise RuntimeError(f"git diff failed: {res.output}")
        return res.output

    async def stop(self) -> None:
        started = time.monotonic()
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
        self.stopped = True
        self.timings.stop_s = time.monotonic() - started


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("toy-cache")


@pytest.fixture(scope="session")
def toys(toy_cache: Path) -> dict[str, SweTask]:
    return {t.instance_id: t for t in toy_tasks(toy_cache)}


@pytest.fixture
async def local_runtimes():  # type: ignore[no-untyped-def]
    """``make(source_dir=None, spec=None)`` → an unprepared LocalRuntime, stopped at teardown."""
    made: list[LocalRuntime] = []

    def make(source_dir: Path | None = None, spec: RuntimeSpec | None = None) -> LocalRuntime:
        rt = LocalRuntime(spec, source_dir=source_dir)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        await rt.stop()


@pytest.fixture
def fresh_factory(local_runtimes):  # type: ignore[no-untyped-def]
    """``fresh_factory(task)`` → a runtime factory building LocalRuntimes on the task's repo; each
    runtime it made is listed in ``factory.made``."""

    def for_task(task: SweTask):  # type: ignore[no-untyped-def]
        def factory() -> LocalRuntime:
            rt = local_runtimes(spec=task.runtime_spec())
            factory.made.append(rt)  # type: ignore[attr-defined]
            return rt

        factory.made = []  # type: ignore[attr-defined]
        return factory

    return for_task
