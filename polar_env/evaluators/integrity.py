"""Grading integrity: what of the agent's diff a grader may run, and how the grader runs it.

The policy under training is an adversary. Anything the test runner or the interpreter loads on its
own — runner configuration, plugins, ``conftest.py`` files, import hooks, site customisation, modules
that shadow the runner or the standard library — is a lever on the reward that no real fix needs.
So every evaluator that runs code grades the same way, under a *named* policy:

1. a fresh runtime from the pristine base (never the agent's own, unless a task asks for it);
2. the agent's diff **restricted** to what a fix may touch: each file section of the patch whose path
   (either side of a rename) matches a protected rule is dropped before applying; after applying,
   a sweep of ``git status`` restores to base anything protected that still changed, and a changed
   ``pyproject.toml`` / ``setup.cfg`` whose runner sections differ from base is restored too;
3. an isolated interpreter environment for the check (no user site, a fresh ``HOME``, a clean
   ``PYTHONPATH``, ``PYTEST_ADDOPTS`` with an explicit ``--rootdir`` and ``-p no:cacheprovider``,
   no ``PYTEST_PLUGINS``; plugin autoload off when the policy says so).

Every dropped path goes into the evaluator report (``dropped_paths``: path and rule) together with
``policy`` (its name), so a trainer can see and penalise attempts. A task widens the policy with
``integrity: {"allow": ["setup.cfg", "docs/conf.py"]}`` in its evaluator params (glob patterns on
repo-relative paths); ``{"policy": "off"}`` disables it and says so in the report.

What the policy cannot stop: code in files a fix must be allowed to edit runs inside the test
process and can tamper with the runner from there. Added lines that reach for the runner's
internals are listed in ``flagged`` (not dropped) for the trainer to inspect.

API for other evaluators (``polar_env.evaluators`` re-exports it): ``resolve_policy(params)``,
``restrict_patch(patch, policy, test_files)``, ``await apply_restricted(runtime, patch, policy,
test_files=..., timeout_s=...)`` and ``grading_env(policy, workdir)``.
"""

from __future__ import annotations

import configparser
import fnmatch
import posixpath
import re
import shlex
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar_env.errors import ConfigError
from polar_env.runtimes.base import Runtime
from polar_env.runtimes.limits import LimitExceeded
from polar_env.tasks.swe import hunk_body_step

# Repos copied into a runtime may belong to another uid; git then refuses them as "dubious".
GIT_ENV = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}
PATCH_FILE = ".git/polar_model.patch"  # inside .git: invisible to git status, git clean and the diff
GRADING_HOME = "/tmp/polar-grading-home"
# The SWE-bench harness's order: strict first, then three-way merge, then partial hunks, then fuzz.
APPLY_COMMANDS = (
    "git apply --verbose {patch}",
    "git apply --verbose --3way {patch}",
    "git apply --verbose --reject {patch}",
    "patch --batch --forward --fuzz=5 -p1 -i {patch}",
)
# `git reset` first: a failed --3way leaves unmerged index entries that `git checkout -- .` refuses.
RESET_COMMAND = "git reset -q && git checkout -- . && git clean -fd"

RUNNER_CONFIG = frozenset({"pytest.ini", ".pytest.ini", "tox.ini"})
SECTIONED_CONFIG = frozenset({"pyproject.toml", "setup.cfg"})  # dropped when their runner sections change
STARTUP_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "unittest", "nose", "nose2", "iniconfig", "conftest"})
STDLIB_MODULES = frozenset(sys.stdlib_module_names)
DIST_METADATA = (".dist-info", ".egg-info", ".egg-link")
# setup.cfg / tox.ini sections and pyproject tables the runner reads
CFG_SECTIONS = ("tool:pytest", "pytest", "coverage:run")
TOML_TABLES = (("tool", "pytest"), ("tool", "coverage"))
_SUSPICIOUS = re.compile(
    r"_pytest|pytest_runtest|pytest_collection|TestReport|pytest_configure|sys\.modules\[['\"]pytest|"
    r"os\._exit|sys\.settrace|builtins\.__import__|import_hook|meta_path|pytest\.hookimpl"
)


class IntegrityPolicy(BaseModel):
    """A named grading-integrity policy. ``allow`` widens it (glob patterns on repo paths)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "pytest-strict"
    enabled: bool = True
    allow: tuple[str, ...] = ()
    protect: tuple[str, ...] = ()  # extra glob patterns to drop, on top of the built-in rules
    drop_symlinks: bool = True
    drop_test_dirs: bool = True  # changes under the test patch's directories (not the repo root)
    plugin_autoload: bool = True  # False: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 (when the suite needs none)


POLICIES: dict[str, IntegrityPolicy] = {
    "pytest-strict": IntegrityPolicy(),
    "pytest-hermetic": IntegrityPolicy(name="pytest-hermetic", plugin_autoload=False),
    "off": IntegrityPolicy(name="off", enabled=False),
}
DEFAULT_POLICY = "pytest-strict"


class IntegrityParams(BaseModel):
    """What a task's evaluator params may say: ``{"policy": name, "allow": [...], "protect": [...]}``."""

    model_config = ConfigDict(extra="forbid")

    policy: str = DEFAULT_POLICY
    allow: list[str] = Field(default_factory=list)
    protect: list[str] = Field(default_factory=list)


def register_policy(policy: IntegrityPolicy, *, replace: bool = False) -> IntegrityPolicy:
    if policy.name in POLICIES and not replace:
        raise ConfigError(f"integrity policy {policy.name!r} is already registered (pass replace=True)")
    POLICIES[policy.name] = policy
    return policy


def resolve_policy(spec: IntegrityParams | Mapping[str, Any] | str | None = None) -> IntegrityPolicy:
    """The policy a task grades under: a registered name, widened by the task's ``allow``."""
    if spec is None:
        spec = IntegrityParams()
    elif isinstance(spec, str):
        spec = IntegrityParams(policy=spec)
    elif not isinstance(spec, IntegrityParams):
        spec = IntegrityParams.model_validate(dict(spec))
    base = POLICIES.get(spec.policy)
    if base is None:
        raise ConfigError(f"unknown integrity policy {spec.policy!r}; known: {', '.join(sorted(POLICIES))}")
    if not spec.allow and not spec.protect:
        return base
    return base.model_copy(update={"allow": (*base.allow, *spec.allow), "protect": (*base.protect, *spec.protect)})


# -- the rules --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dropped:
    path: str
    rule: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "rule": self.rule}


def _test_dirs(test_files: Iterable[str]) -> set[str]:
    return {d for d in (posixpath.dirname(p) for p in test_files) if d}


def protected_rule(path: str, policy: IntegrityPolicy, *, added: bool, test_files: Sequence[str] = ()) -> str | None:
    """Why ``path`` (repo-relative) is off limits to a fix, or None. ``added``: not in the base."""
    if not policy.enabled or any(fnmatch.fnmatchcase(path, pat) for pat in policy.allow):
        return None
    parts = [p for p in path.split("/") if p]
    if not parts:
        return None
    name = parts[-1]
    stem = name.removesuffix(".py")
    if path in test_files:
        return "test file (owned by the test patch)"
    if name == "conftest.py":
        return "runner plugin (conftest.py)"
    if name in RUNNER_CONFIG:
        return f"runner config ({name})"
    if name in SECTIONED_CONFIG and added:
        return f"runner config ({name}, added)"
    if name.endswith(".pth"):
        return "interpreter startup hook (.pth)"
    if name in STARTUP_HOOKS:
        return f"interpreter startup hook ({name})"
    if any(p.endswith(DIST_METADATA) for p in parts):
        return "distribution metadata (entry-point plugins)"
    if parts[0] == ".git" or name == ".gitattributes":
        return "git metadata"
    if added:
        modules = {p.removesuffix(".py") for p in parts}
        if modules & RUNNER_MODULES:
            return "module shadowing the test runner"
        top = parts[0].removesuffix(".py")
        in_test_dir = posixpath.dirname(path) in _test_dirs(test_files)
        if (len(parts) == 1 or parts[0] == "src" and len(parts) == 2) and top in STDLIB_MODULES:
            return "module shadowing the standard library"
        if len(parts) > 1 and parts[0] != "src" and top in STDLIB_MODULES and parts[1] == "__init__.py":
            return "module shadowing the standard library"
        if in_test_dir and stem in STDLIB_MODULES:
            return "module shadowing the standard library (test directory on sys.path)"
    if policy.drop_test_dirs:
        dirs = _test_dirs(test_files)
        if any(path.startswith(d + "/") for d in dirs):
            return "test directory (the runner imports it)"
    if any(fnmatch.fnmatchcase(path, pat) for pat in policy.protect):
        return "protected by the task"
    return None


# -- splitting and restricting a patch ---------------------------------------------------------------

_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


@dataclass(slots=True)
class Section:
    lines: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    added: bool = False
    symlink: bool = False


def _unquote(path: str) -> str:
    if path.startswith('"') and path.endswith('"'):
        return path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1").decode()
    return path


def _side(text: str, prefix: str) -> str | None:
    path = _unquote(text.split("\t", 1)[0].rstrip())
    if path == "/dev/null":
        return None
    path = path.removeprefix(prefix)
    return posixpath.normpath(path) if path else None


def split_patch(patch: str) -> tuple[list[str], list[Section]]:
    """(lines before the first file section, the file sections). Hunk bodies are skipped by their
    line counts, so a body line that looks like a header does not start a section."""
    preamble: list[str] = []
    sections: list[Section] = []
    cur: Section | None = None
    old_left = new_left = 0
    lines = patch.splitlines(keepends=True)
    for i, line in enumerate(lines):
        bare = line.rstrip("\r\n")
        if old_left > 0 or new_left > 0:
            old_left, new_left = hunk_body_step(bare[:1], old_left, new_left)
            assert cur is not None
            cur.lines.append(line)
            continue
        starts = bare.startswith("diff --git ") or (
            bare.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
            and (cur is None or any(_HUNK.match(x) for x in cur.lines))
        )
        if starts:
            cur = Section()
            sections.append(cur)
        if cur is None:
            preamble.append(line)
            continue
        cur.lines.append(line)
        if bare.startswith("diff --git "):
            rest = bare[len("diff --git ") :]
            if rest.startswith("a/") and " b/" in rest and len(rest) % 2 == 1:
                half = (len(rest) - 1) // 2
                cur.paths += [rest[2:half], rest[half + 3 :]]
            else:
                for m in re.finditer(r'(?:^|\s)(?:"?[ab]/)([^"\s]+)', rest):
                    cur.paths.append(m.group(1))
        elif bare.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            cur.paths.append(bare.split(" ", 2)[2])
        elif bare.startswith("new file mode"):
            cur.added = True
            cur.symlink |= bare.endswith("120000")
        elif bare.startswith(("new mode", "old mode")):
            cur.symlink |= bare.endswith("120000")
        elif bare.startswith("--- "):
            p = _side(bare[4:], "a/")
            if p is None:
                cur.added = True
            else:
                cur.paths.append(p)
        elif bare.startswith("+++ "):
            p = _side(bare[4:], "b/")
            if p is not None:
                cur.paths.append(p)
        elif hunk := _HUNK.match(bare):
            old_left = int(hunk.group(1)) if hunk.group(1) is not None else 1
            new_left = int(hunk.group(2)) if hunk.group(2) is not None else 1
    for s in sections:
        s.paths = list(dict.fromkeys(posixpath.normpath(_unquote(p)) for p in s.paths if p))
    return preamble, sections


@dataclass(slots=True)
class Restricted:
    """The patch a grader applies, what was dropped from it, and added lines worth a look."""

    patch: str
    kept: list[str]
    dropped: list[Dropped]
    flagged: list[dict[str, str]]


def restrict_patch(patch: str, policy: IntegrityPolicy, test_files: Sequence[str] = ()) -> Restricted:
    preamble, sections = split_patch(patch)
    kept_lines: list[str] = list(preamble) if not sections else []
    kept: list[str] = []
    dropped: list[Dropped] = []
    flagged: list[dict[str, str]] = []
    for s in sections:
        rule = None
        for p in s.paths or ["?"]:
            if p.startswith(("../", "/")) or p == "..":
                rule = "path outside the repository"
            elif policy.enabled and policy.drop_symlinks and s.symlink and not any(
                fnmatch.fnmatchcase(p, pat) for pat in policy.allow
            ):
                rule = "symlink"
            else:
                rule = protected_rule(p, policy, added=s.added, test_files=test_files)
            if rule is not None:
                break
        if rule is not None:
            dropped += [Dropped(p, rule) for p in s.paths or ["?"]]
            continue
        kept += s.paths
        kept_lines += s.lines
        for line in s.lines:
            if line.startswith("+") and not line.startswith("+++") and _SUSPICIOUS.search(line):
                flagged.append({"path": s.paths[-1] if s.paths else "?", "line": line[1:].strip()[:200]})
    return Restricted("".join(kept_lines), kept, dropped, flagged[:50])


def sectioned_config_changed(name: str, base: str | None, new: str | None) -> bool:
    """True when the runner sections of a pyproject.toml / setup.cfg differ (or cannot be read)."""

    def sections(text: str | None) -> Any:
        if text is None:
            return None
        if name.endswith(".toml"):
            doc = tomllib.loads(text)
            return [_dig(doc, keys) for keys in TOML_TABLES]
        parser = configparser.RawConfigParser(strict=False)
        parser.read_string(text)
        return [dict(parser.items(s)) if parser.has_section(s) else None for s in CFG_SECTIONS]

    try:
        return bool(sections(base) != sections(new))
    except (tomllib.TOMLDecodeError, configparser.Error, UnicodeDecodeError):
        return True


def _dig(doc: Any, keys: Sequence[str]) -> Any:
    for k in keys:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


# -- in the grading runtime ---------------------------------------------------------------------------


def grading_env(policy: IntegrityPolicy, workdir: str) -> dict[str, str]:
    """The interpreter environment a check runs under: nothing the agent could have planted."""
    if not policy.enabled:
        return dict(GIT_ENV)
    env = {
        **GIT_ENV,
        "HOME": GRADING_HOME,
        "PYTHONNOUSERSITE": "1",
        "PYTHONPATH": "",
        "PYTHONSTARTUP": "",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONWARNINGS": "",
        "PYTEST_PLUGINS": "",
        "PYTEST_ADDOPTS": f"-p no:cacheprovider --rootdir={shlex.quote(workdir)}",
    }
    if not policy.plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


async def prepare_grading_home(runtime: Runtime, policy: IntegrityPolicy) -> None:
    if policy.enabled:
        await runtime.exec(f"rm -rf {GRADING_HOME} && mkdir -p {GRADING_HOME}", timeout_s=60.0)


@dataclass(slots=True)
class Applied:
    """What ``apply_restricted`` did, for the evaluator report (``as_report``)."""

    policy: IntegrityPolicy
    method: str | None = None
    dropped: list[Dropped] = field(default_factory=list)
    flagged: list[dict[str, str]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return self.method is not None

    def as_report(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name if self.policy.enabled else "off",
            "dropped_paths": [d.as_dict() for d in self.dropped],
            "flagged": self.flagged,
        }


async def apply_restricted(
    runtime: Runtime, patch: str, policy: IntegrityPolicy, *, test_files: Sequence[str] = (), timeout_s: float = 120.0
) -> Applied:
    """Apply ``patch`` restricted by ``policy`` in the (fresh) grading ``runtime``, then sweep: any
    protected path that still differs from base is restored. ``method`` is None when nothing applies."""
    out = Applied(policy)
    cap = getattr(runtime.spec, "patch_mb", None)
    if cap is not None and len(patch) > cap * 1024 * 1024:  # a patch handed over as text, not via diff()
        raise LimitExceeded("patch_mb", f"the patch is {len(patch) / 2**20:.1f} MiB, over patch_mb={cap:g}")
    restricted = restrict_patch(patch, policy, test_files)
    out.dropped, out.flagged, out.kept = list(restricted.dropped), restricted.flagged, restricted.kept
    await prepare_grading_home(runtime, policy)
    if not restricted.patch.strip():
        out.method = "none (nothing left to apply)" if restricted.dropped else None
        return out
    workdir = runtime.spec.workdir
    body = restricted.patch if restricted.patch.endswith("\n") else restricted.patch + "\n"
    await runtime.write_file(posixpath.join(workdir, PATCH_FILE), body.encode())
    for template in APPLY_COMMANDS:
        command = template.format(patch=PATCH_FILE)
        res = await runtime.exec(command, env=GIT_ENV, cwd=workdir, timeout_s=timeout_s)
        out.logs.append({"command": command, "exit_code": res.exit_code, "timed_out": res.timed_out,
                         "output": res.output[-4000:]})
        if res.exit_code == 0 and not res.timed_out:
            out.method = template.replace(" -i {patch}", "").replace(" {patch}", "")
            break
        reset = await runtime.exec(RESET_COMMAND, env=GIT_ENV, cwd=workdir, timeout_s=timeout_s)
        if reset.exit_code != 0:
            raise RuntimeError(f"cannot reset the grading workspace after a failed apply: {reset.output[-2000:]}")
    if out.method is not None:
        out.dropped += await sweep(runtime, policy, test_files=test_files)
    return out


async def sweep(runtime: Runtime, policy: IntegrityPolicy, *, test_files: Sequence[str] = ()) -> list[Dropped]:
    """Restore to base every protected path that differs from base after applying."""
    if not policy.enabled:
        return []
    workdir = runtime.spec.workdir
    res = await runtime.exec("git status --porcelain=v1 -z --untracked-files=all", env=GIT_ENV, cwd=workdir,
                             timeout_s=120.0)
    if res.exit_code != 0:
        if "not a git repository" in res.output:
            return []  # nothing to compare with: what applied is the restricted patch
        raise RuntimeError(f"cannot list the grading workspace's changes: {res.output[-2000:]}")
    entries = [e for e in res.output.split("\0") if e]
    changed: list[tuple[str, bool]] = []
    skip = False
    for entry in entries:
        if skip:  # the source path of a rename (porcelain -z puts it after the target)
            skip = False
            continue
        code, path = entry[:2], entry[3:]
        skip = code[0] in "RC"
        changed.append((path.rstrip("/"), code == "??" or "A" in code))
    dropped: list[Dropped] = []
    for path, added in changed:
        rule = protected_rule(path, policy, added=added, test_files=test_files)
        if rule is None and not added and posixpath.basename(path) in SECTIONED_CONFIG:
            base = await runtime.exec(f"git show HEAD:{shlex.quote(path)}", env=GIT_ENV, cwd=workdir, timeout_s=60.0)
            try:
                new = (await runtime.read_file(posixpath.join(workdir, path))).decode("utf-8")
            except (OSError, UnicodeDecodeError, ConfigError):
                new = None
            if sectioned_config_changed(path, base.output if base.exit_code == 0 else None, new):
                rule = f"runner config ({posixpath.basename(path)} runner sections changed)"
        if rule is None:
            continue
        dropped.append(Dropped(path, rule + " [restored after apply]"))
        restore = (f"rm -rf -- {shlex.quote(path)}" if added
                   else f"git checkout HEAD -- {shlex.quote(path)}")
        done = await runtime.exec(restore, env=GIT_ENV, cwd=workdir, timeout_s=60.0)
        if done.exit_code != 0:
            raise RuntimeError(f"cannot restore {path} to base: {done.output[-2000:]}")
    return dropped


async def fresh_graded_runtime(
    ctx: Any, *, integrity: IntegrityParams | Mapping[str, Any] | str | None = None,
    test_files: Sequence[str] = (), timeout_s: float = 120.0,
) -> tuple[Runtime, Applied, dict[str, str]]:
    """For custom evaluators: the context's fresh runtime with the agent's diff applied under the
    policy, the ``Applied`` record (``.as_report()`` goes into the evaluator's report) and the
    environment to run checks under. ``ctx`` is an ``EvalContext``; ``integrity`` defaults to
    ``ctx.params["integrity"]``. Raises ``ConfigError`` when the diff does not apply."""
    policy = resolve_policy(integrity if integrity is not None else ctx.params.get("integrity"))
    runtime = await ctx.fresh_runtime()
    patch = ctx.patch if ctx.patch is not None else (await ctx.agent_runtime().diff() if ctx.runtime else "")
    applied = await apply_restricted(runtime, patch, policy, test_files=test_files, timeout_s=timeout_s)
    if patch.strip() and not applied.applied:
        raise ConfigError(f"the agent's diff does not apply to a fresh runtime: {applied.logs[-1:]}")
    return runtime, applied, grading_env(policy, runtime.spec.workdir)
