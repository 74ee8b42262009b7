"""Grading integrity: the contract every evaluator that runs the agent's code grades under.

The policy under training is an adversary, and a blocklist is always one name short. So grading
holds by construction:

1. **The grader computes the change itself** (``workspace.py``): it walks the agent's workspace from
   outside and compares it with the pristine base it took before the agent ran — never through the
   agent's ``.git``. A text patch handed in instead (the Python API) is applied by git in a scratch
   copy of the grader's own fresh base, and the change is read off the resulting files.
2. **Allow-list** (``admit``): only regular, text, non-executable files under paths a fix may change
   reach the grading runtime — existing files of the repo's source tree, and new source files inside
   an existing package (so no new module can shadow the runner, its plugins or the standard library).
   Everything else is dropped and listed in ``dropped_paths`` with the rule: links and special
   files, binaries, bytecode and extension modules, dot-files and dot-folders and package metadata in
   any case, runner and packaging config, anything in a test location; under every policy, names
   that are not UTF-8 text and paths inside a base file or a dropped path (the fresh runtime could
   not hold them). The grader *writes* the admitted files into a fresh runtime; nothing is parsed
   twice. A change it cannot write by the change's own doing is the agent's (``agent_fault``).
3. **A hermetic run** (``grading_env``): no user site, a fresh ``HOME``, a clean ``PYTHONPATH`` (the
   grader's plugin directory only), no cache provider, an explicit ``--rootdir``, ``PYTEST_PLUGINS``
   empty; with the grader's plugin also ``PYTHONSAFEPATH`` (the workspace is off ``sys.path`` while
   the runner and its plugins import) and bytecode only from a grader-owned cache prefix.
4. **Results out of band and canaries** (``results.py``, ``pytest_grader.py``).

A task widens the allow-list with ``integrity: {"allow": ["setup.cfg", "docs/*.rst"]}`` (glob patterns
on repo paths; the name rules are lifted for those paths, the kind rules stay) and narrows it with
``protect``. ``{"policy": "off"}`` admits every changed regular file and says so in the report.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import json
import posixpath
import shlex
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_env.errors import ConfigError
from polar_env.evaluators.report import ApplyLog, EvalReport
from polar_env.evaluators.scan import PY_SUFFIXES, RULES, Finding, scan_change
from polar_env.evaluators.workspace import Change, Changes, Manifest, WorkspaceBroken, is_text, read, snapshot, unified
from polar_env.runtimes.base import Runtime, limit_hit_of
from polar_env.runtimes.limits import LimitExceeded
from polar_env.safetext import bad_name, shown

# Repos copied into a runtime may belong to another uid; git then refuses them as "dubious".
GIT_ENV = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}
GRADING_HOME = "/tmp/polar-grading-home"

RUNNER_CONFIG = frozenset({"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "conftest.py",
                           "noxfile.py", "manifest.in", "sitecustomize.py", "usercustomize.py", "pytest.toml"})
COMPILED_SUFFIXES = (".pyc", ".pyo", ".pyd", ".so", ".dll", ".dylib", ".pth", ".egg", ".whl", ".zip", ".exe")
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", "__pycache__")
TEST_DIRS = frozenset({"test", "tests", "testing"})
MODULE_SUFFIXES = (".py", ".pyi", ".pyw", ".pyx", ".pxd")
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "unittest", "nose", "nose2", "iniconfig", "conftest",
                            "site", "sitecustomize", "usercustomize", "xdist", "pytest_cov", "coverage"})
# the grading interpreter's importable top-level names (stdlib and site-packages); cwd "/" keeps the
# workspace out of it
IMPORTABLE_PROBE = ("import sys, pkgutil, json; print(json.dumps(sorted(set(getattr(sys, 'stdlib_module_names', ())) "
                    "| set(sys.builtin_module_names) | {m.name for m in pkgutil.iter_modules()})))")
NEW_FILE_SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".txt", ".json", ".yaml", ".yml", ".csv", ".md", ".rst",
                     ".html", ".css", ".js", ".xml", ".sql", ".j2", ".jinja")
# Rules of every policy ("off" too): the grading runtime could not hold such a path, or the report
# could not carry its name.
BAD_NAME = "a name that is not valid UTF-8 or holds a control character"
INSIDE_BASE_FILE = "inside a path the base holds as a file, symlink or special file"
INSIDE_DROPPED = "inside a dropped path"


class IntegrityPolicy(BaseModel):
    """A named grading-integrity policy. ``allow`` widens it, ``protect`` narrows it (glob patterns
    on repo-relative paths); ``canaries`` must-pass and as many must-fail canaries per run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "allowlist"
    enabled: bool = True
    allow: tuple[str, ...] = ()
    protect: tuple[str, ...] = ()
    canaries: int = Field(default=3, ge=0)
    # "source": a new file needs a source or data suffix (a repo's fix); "any": any text file (a task
    # whose deliverable is the workspace: Harbor, output commands). Name and kind rules hold for both.
    new_files: Literal["source", "any"] = "source"
    plugin_autoload: bool = True  # False: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, and only ``plugins`` are loaded
    plugins: tuple[str, ...] = ()  # pytest plugins loaded by name (``-p``) under plugin_autoload False
    scan_ignore: tuple[str, ...] = ()  # scan.py rules a task's real fixes trip (a pytest plugin's repo: RUNNER_RULES)


POLICIES: dict[str, IntegrityPolicy] = {
    "allowlist": IntegrityPolicy(),
    "allowlist-hermetic": IntegrityPolicy(name="allowlist-hermetic", plugin_autoload=False),
    "allowlist-workspace": IntegrityPolicy(name="allowlist-workspace", new_files="any"),
    "off": IntegrityPolicy(name="off", enabled=False, canaries=0),
}
DEFAULT_POLICY = "allowlist"
WORKSPACE_POLICY = "allowlist-workspace"


class IntegrityParams(BaseModel):
    """What a task's evaluator params may say: ``{"policy": name, "allow": [...], "protect": [...]}``."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = None  # None: the evaluator's default (swebench "allowlist"; output, harbor "allowlist-workspace")
    allow: list[str] = Field(default_factory=list)
    protect: list[str] = Field(default_factory=list)
    canaries: int | None = Field(default=None, ge=0)
    # the pytest plugins the task's suite needs (``-p`` names, e.g. "xdist.plugin", "pytest_benchmark.plugin"),
    # loaded by name when the policy turns autoloading off (allowlist-hermetic)
    plugins: list[str] = Field(default_factory=list)
    scan_ignore: list[str] = Field(default_factory=list)  # rule names of scan.RULES the task's fixes may trip


def register_policy(policy: IntegrityPolicy, *, replace: bool = False) -> IntegrityPolicy:
    if policy.name in POLICIES and not replace:
        raise ConfigError(f"integrity policy {policy.name!r} is already registered (pass replace=True)")
    POLICIES[policy.name] = policy
    return policy


def resolve_policy(spec: IntegrityParams | Mapping[str, object] | str | None = None, *,
                   default: str = DEFAULT_POLICY) -> IntegrityPolicy:
    """The policy a task grades under: a registered name (``default`` when the task names none),
    widened or narrowed by the task."""
    if spec is None:
        spec = IntegrityParams()
    elif isinstance(spec, str):
        spec = IntegrityParams(policy=spec)
    elif not isinstance(spec, IntegrityParams):
        spec = IntegrityParams.model_validate(dict(spec))
    name = spec.policy or default
    base = POLICIES.get(name)
    if base is None:
        raise ConfigError(f"unknown integrity policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    update: dict[str, Any] = {}
    if spec.allow or spec.protect:
        update = {"allow": (*base.allow, *spec.allow), "protect": (*base.protect, *spec.protect)}
    if spec.canaries is not None:
        update["canaries"] = spec.canaries
    if spec.plugins:
        update["plugins"] = (*base.plugins, *spec.plugins)
    if spec.scan_ignore:
        unknown = sorted(set(spec.scan_ignore) - set(RULES))
        if unknown:
            raise ConfigError(f"unknown scan rule(s) {unknown} in integrity.scan_ignore; known: {', '.join(sorted(RULES))}")
        update["scan_ignore"] = (*base.scan_ignore, *spec.scan_ignore)
    return base.model_copy(update=update) if update else base


# -- the allow-list ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dropped:
    path: str
    rule: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "rule": self.rule}


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pat) for pat in patterns)


def in_test_location(path: str, test_files: Sequence[str] = ()) -> bool:
    """Whether ``path`` is where tests live: the test patch's files and folders, test folders, test modules."""
    if path in test_files:
        return True
    dirs = {d for d in (posixpath.dirname(p) for p in test_files) if d}
    if any(path.startswith(d + "/") for d in dirs):
        return True
    parts = path.casefold().split("/")
    name = parts[-1]
    return bool(TEST_DIRS.intersection(parts[:-1])) or (name.endswith(".py") and (name.startswith("test_")
                                                                                   or name.endswith("_test.py")))


def name_rule(path: str, test_files: Sequence[str] = ()) -> str | None:
    """Why a path is no place for a fix, or None. Case-insensitive: a case-folding filesystem or
    importer must not make ``.GIT`` or ``X.DIST-INFO`` a way in."""
    parts = path.casefold().split("/")
    name = parts[-1]
    if any(p.startswith(".") for p in parts):
        return "dot-file or dot-folder"
    if any(p.endswith(METADATA_SUFFIXES) for p in parts):
        return "package metadata or bytecode folder"
    if name.endswith(COMPILED_SUFFIXES):
        return "compiled module, bytecode or interpreter hook"
    if name in RUNNER_CONFIG:
        return "runner or packaging config"
    if in_test_location(path, test_files):
        return "test location (tests come from the pristine base and the test patch)"
    return None


def _in_package(path: str, base: Manifest) -> bool:
    """Whether ``path`` lies inside a package of the base (an ancestor holds ``__init__.py``)."""
    parts = path.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        init = base.get("/".join([*parts[:i], "__init__.py"]))
        if init is not None and init.kind == "file":
            return True
    return False


def _shadowed(path: str, reserved: frozenset[str] | None) -> str | None:
    """The importable name a new module outside the packages would shadow (``"*"``: unknown)."""
    parts = path.split("/")
    for name in [*parts[:-1], posixpath.splitext(parts[-1])[0]]:
        if name in RUNNER_MODULES:
            return name
        if reserved is None:
            return "*"
        if name in reserved:
            return name
    return None


def _inside(path: str, base: Manifest, dropped: Set[str]) -> str | None:
    """Why ``path`` cannot be written where it lies: an ancestor is a file, symlink or special file of
    the base (the fresh runtime holds that, not a directory: a base file replaced by a directory), or
    an ancestor's own change was dropped (what lies under a dropped path goes with it)."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        parent = "/".join(parts[:i])
        if parent in dropped:
            return INSIDE_DROPPED
        entry = base.get(parent)
        if entry is not None and entry.kind != "dir":
            return INSIDE_BASE_FILE
    return None


def rule_for(change: Change, policy: IntegrityPolicy, base: Manifest, test_files: Sequence[str] = (),
             reserved: frozenset[str] | None = None, *, dropped: Set[str] = frozenset()) -> str | None:
    """Why ``change`` is dropped under ``policy``, or None when a fix may make it. ``dropped``: the
    paths already dropped (a path under one is dropped too)."""
    if bad_name(change.path):
        return BAD_NAME
    inside = _inside(change.path, base, dropped)
    if inside is not None:
        return inside
    new, old = change.new, change.old
    if new is not None and new.kind != "file":
        return {"link": "symlink", "dir": "a file replaced by a directory"}.get(new.kind, "not a regular file")
    if old is not None and old.kind != "file":
        return "replaces a symlink, directory or special file of the base"
    if not policy.enabled:
        return None if new is None or change.data is not None else "over the size the grader reads"
    if new is not None:
        if change.data is None:
            return "over the size the grader reads"
        if not is_text(change.data):
            return "binary content"
        if new.mode & 0o111 and (old is None or not old.mode & 0o111):
            return "made executable"
    if _matches(change.path, policy.protect):
        return "protected by the task"
    if _matches(change.path, policy.allow):
        return None
    rule = name_rule(change.path, test_files)
    if rule is not None:
        return rule
    if old is None:
        if policy.new_files == "source" and not change.path.casefold().endswith(NEW_FILE_SUFFIXES):
            return "a new file of a kind a fix does not add"
        if not _in_package(change.path, base) and change.path.casefold().endswith(MODULE_SUFFIXES):
            shadow = _shadowed(change.path, reserved)
            if shadow is not None:
                return ("a new module outside the repo's packages, and the grader could not list what it may shadow"
                        if shadow == "*" else f"a new module shadowing the importable module {shadow!r}")
    return None


@dataclass(slots=True)
class Admitted:
    kept: list[Change] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)


def needs_importable(changes: Changes, base: Manifest) -> bool:
    """Whether admitting ``changes`` needs the grading interpreter's importable names."""
    return any(c.old is None and c.path.casefold().endswith(MODULE_SUFFIXES) and not _in_package(c.path, base)
               for c in changes.items)


async def importable_names(runtime: Runtime) -> frozenset[str] | None:
    """The grading interpreter's importable top-level names, or None when it cannot say."""
    res = await runtime.exec(["python3", "-I", "-c", IMPORTABLE_PROBE], cwd="/", timeout_s=120.0)
    try:
        names = json.loads(res.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return frozenset(str(n) for n in names) if res.exit_code == 0 and isinstance(names, list) else None


def admit(changes: Changes, policy: IntegrityPolicy, base: Manifest, test_files: Sequence[str] = (),
          reserved: frozenset[str] | None = None) -> Admitted:
    """Each change kept or dropped with its rule. ``reserved``: the names a new top-level module may
    not take (None: any new top-level module is dropped). Dropped paths are listed ``shown`` (escaped
    UTF-8 text). Two passes, so a path under a dropped one goes with it whatever the order."""
    out = Admitted()
    rules = [(c, rule_for(c, policy, base, test_files, reserved)) for c in changes.items]
    gone = {c.path for c, rule in rules if rule is not None}
    for change, rule in rules:
        if rule is None and gone:
            rule = _inside(change.path, {}, gone)
        if rule is None:
            out.kept.append(change)
        else:
            out.dropped.append(Dropped(shown(change.path), rule))
    return out


# -- the agent's breakage is the agent's -------------------------------------------------------------

# errnos of a file call that describe the path or the bytes written, not the runtime
CONTENT_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.EILSEQ,
                            errno.EFBIG, errno.EMLINK})
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True, slots=True)
class AgentFault:
    """Why the agent's change could not be taken or written: reward 0, unmasked; ``limit``: the
    RuntimeSpec limit it went over (the session ends ``limit_exceeded``)."""

    reason: str
    limit: str | None = None


def _limit_name(hit: str) -> str:
    return hit.split("=", 1)[0]


async def agent_fault(runtime: Runtime, exc: Exception) -> AgentFault | None:
    """Whether ``exc``, raised while taking, admitting or writing the agent's change into the fresh
    ``runtime``, is the change's doing (an ``AgentFault``: graded 0, unmasked) or the grading
    runtime's (None: the caller re-raises it, an ``evaluator_error``, masked).

    The change's doing: a limit hit the grading runtime reports (it started pristine; what ran in
    it since was the grader holding the change); ``LimitExceeded`` (the change is over ``patch_mb``,
    or holding it went over a limit); ``WorkspaceBroken`` (the agent's workspace, or what its patch
    made, cannot be taken); an ``OSError`` whose errno describes the path or the bytes
    (``CONTENT_ERRNOS``: a directory where the base has a file, a name too long, ...), and ``ENOSPC``
    or ``EDQUOT`` when the runtime then reports its disk limit hit; a ``UnicodeError`` (a name the
    runtime's file API cannot carry).

    The grading runtime's: everything else. It failed to start (raised before the change is taken,
    never passed here), its exec or file API failed (``ConfigError``, ``RuntimeError``, a lost
    connection, ``EACCES``, ``EIO``, ``EROFS``), or it is out of space with no disk limit hit (the
    host's disk)."""
    if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
        try:  # an exec re-reads the runtime's limits (a full sized tmpfs trips disk_mb)
            await runtime.exec(["true"], cwd="/", timeout_s=60.0)
        except Exception:  # noqa: BLE001 - a runtime that cannot run `true` failed itself
            return None
    hit = limit_hit_of(runtime)
    if hit is not None:
        return AgentFault(f"the grading runtime went over a limit while the agent's change was written: {hit}", _limit_name(hit))
    if isinstance(exc, LimitExceeded):
        return AgentFault(str(exc), exc.limit)
    if isinstance(exc, WorkspaceBroken):
        return AgentFault(str(exc))
    if isinstance(exc, OSError) and exc.errno in CONTENT_ERRNOS:
        return AgentFault(f"the grading runtime cannot hold the agent's change: {exc}")
    if isinstance(exc, UnicodeError):
        return AgentFault(f"the grading runtime cannot carry a name of the agent's change: {exc}")
    return None


# -- into the grading runtime ---------------------------------------------------------------------


async def write_admitted(runtime: Runtime, kept: Sequence[Change]) -> None:
    """Write the admitted files into the (fresh) runtime's workspace and delete the admitted
    deletions; modes stay the base's (a new file is 0644)."""
    workdir = runtime.spec.workdir
    gone = [c.path for c in kept if c.new is None]
    for c in kept:
        if c.new is not None and c.data is not None:
            await runtime.write_file(posixpath.join(workdir, c.path), c.data)
    for i in range(0, len(gone), 200):
        res = await runtime.exec("rm -f -- " + " ".join(shlex.quote(p) for p in gone[i:i + 200]), cwd=workdir,
                                 timeout_s=120.0)
        if res.exit_code != 0:
            raise RuntimeError(f"cannot delete admitted paths in the grading runtime: {res.output[-2000:]}")


@dataclass(slots=True)
class Graded:
    """What reached the grader, for the evaluator report (``as_report``)."""

    policy: IntegrityPolicy
    changes: Changes
    kept: list[Change] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    patch: str = ""  # the admitted change as a unified diff, for people
    apply_logs: list[ApplyLog] = field(default_factory=list)
    fault: AgentFault | None = None  # the change could not be taken or written: the agent's doing
    findings: list[Finding] = field(default_factory=list)  # scan.py: what the admitted Python adds that tampers

    @property
    def broken(self) -> str | None:
        """Why there is nothing to grade (reward 0, unmasked), or None."""
        return self.fault.reason if self.fault is not None else self.changes.broken

    @property
    def empty(self) -> bool:
        return not self.kept

    def as_report(self) -> EvalReport:
        """The report fields; ``limit`` (read by the session as ``limit_exceeded``) only when the
        change went over one."""
        report: EvalReport = {"policy": self.policy.name if self.policy.enabled else "off", "change_source": self.changes.source,
                  "graded_paths": [c.path for c in self.kept], "dropped_paths": [d.as_dict() for d in self.dropped],
                  "graded_patch": self.patch}
        if self.fault is not None and self.fault.limit is not None:
            report["limit"] = self.fault.limit
        if self.findings:
            report["scan_findings"] = [f.as_dict() for f in self.findings[:50]]
        return report


def _text(data: bytes | None) -> str | None:
    try:
        return data.decode("utf-8") if data is not None else None
    except UnicodeDecodeError:
        return None


async def grade_changes(runtime: Runtime, changes: Changes, policy: IntegrityPolicy, *,
                        test_files: Sequence[str] = (), base: Manifest | None = None) -> Graded:
    """Admit ``changes`` under ``policy`` against the fresh ``runtime``'s pristine workspace (``base``,
    its manifest, when the caller already took one) and write what passes into it. Nothing is
    written for a broken change set; a write that fails by the change's doing (``agent_fault``) sets
    ``fault``, any other failure is raised."""
    graded = Graded(policy, changes)
    if changes.broken is not None or not changes.items:
        return graded
    if base is None:
        base = await snapshot(runtime, digests=False)
    reserved = await importable_names(runtime) if policy.enabled and needs_importable(changes, base) else None
    admitted = admit(changes, policy, base, test_files, reserved)
    graded.kept, graded.dropped = admitted.kept, admitted.dropped
    raw: dict[str, bytes | None] = {}
    for c in graded.kept:
        if c.old is not None:
            try:
                raw[c.path] = await read(runtime, posixpath.join(runtime.spec.workdir, c.path))
            except (OSError, ConfigError):
                raw[c.path] = None
    originals = {p: _text(b) for p, b in raw.items()}
    graded.patch = unified(graded.kept, originals.get)
    if policy.enabled:
        files = [(c.path, raw.get(c.path), c.data) for c in graded.kept if c.path.endswith(PY_SUFFIXES)]
        if files:
            graded.findings = await asyncio.to_thread(scan_change, files, ignore=policy.scan_ignore)
    try:
        await write_admitted(runtime, graded.kept)
    except Exception as exc:
        graded.fault = await agent_fault(runtime, exc)
        if graded.fault is None:
            raise
    return graded


def grading_env(policy: IntegrityPolicy, workdir: str, extra: Mapping[str, str] | None = None, *,
                safe_path: bool = False) -> dict[str, str]:
    """The interpreter environment a check runs under: nothing the agent could have planted.
    ``extra``: the reporter's variables (its plugin directory is the only ``PYTHONPATH`` entry);
    ``safe_path``: ``PYTHONSAFEPATH`` too (a pytest run under the grader's plugin, which restores
    the working directory for ``python -m pytest``; other checks may run scripts that import their
    neighbours)."""
    if not policy.enabled:
        return {**GIT_ENV, **(extra or {})}
    extra = dict(extra or {})
    plugin = f" -p {extra.pop('POLAR_GRADER_PLUGIN')}" if "POLAR_GRADER_PLUGIN" in extra else ""
    env = {
        **GIT_ENV,
        "HOME": GRADING_HOME,
        "PYTHONNOUSERSITE": "1",
        "PYTHONPATH": "",
        "PYTHONSTARTUP": "",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONWARNINGS": "",
        "PYTHONINSPECT": "",
        "PYTEST_PLUGINS": "",
        "PYTEST_ADDOPTS": f"-p no:cacheprovider --rootdir={shlex.quote(workdir)}{plugin}",
        **extra,
    }
    if plugin and safe_path:
        env["PYTHONSAFEPATH"] = "1"
    if not policy.plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        env["PYTEST_ADDOPTS"] += "".join(f" -p {shlex.quote(name)}" for name in policy.plugins)
    return env


async def prepare_grading_home(runtime: Runtime, policy: IntegrityPolicy) -> None:
    if policy.enabled:
        await runtime.exec(f"rm -rf {GRADING_HOME} && mkdir -p {GRADING_HOME}", cwd="/", timeout_s=60.0)
