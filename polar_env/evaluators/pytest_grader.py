# ruff: noqa: UP006, UP035, UP045, B905  (this file runs on Python 3.6: typing generics, zip without strict=)
"""The grader's pytest plugin: authenticated results and canaries written into the real test files.

This file is copied into the grading runtime (a directory named at random under ``/tmp``) and
loaded by name (``-p polar_grader``) into the *task's* interpreter, whatever it is: Python 3.6 to
3.13, pytest 4.6 to 8 (so: no ``from __future__ import annotations``, no ``pytest.Config`` at def
time, nothing newer than those versions have). It imports nothing from polar_env. At import it
reads its one-use configuration and deletes it, then:

- **Results leave as they are made.** Every record (a test report, a collection error, the plan,
  the finish) is appended to the report file as one JSON line with a sequence number and an
  HMAC-SHA256 under a key that is replaced by its own hash after each line (a ratchet): code that
  gains control later can at most add lines after its own arrival, never rewrite or remove one
  already written (a gap, a repeat or a bad MAC is evidence the grader reads). The first line
  is also printed to stderr (the grader captures it outside the sandbox), so a report file that
  was truncated or removed is evidence too, not a lost run.
- **Canaries are copies of the task's own tests**, written into the test module's file on disk
  before anything imports it: a "same" copy of a real test (it must come out as its original does)
  and a "fail" copy with one more assertion that fails (it must not pass). They call the project's
  code, carry its fixtures and decorators, sit next to their originals and are named like them;
  the plan (which node ids are copies of which) goes to the report before project code can run.
- **Skips and xfails say where they came from** (``origin``: the file that raised them; ``xfail``:
  from a mark or a call), and the plan lists which test files mention xfail at all, so the grader
  can refuse an XFAIL or SKIP raised from the code a fix may edit.
- the failing copies are the grader's, not the suite's: when they are all that failed, the
  session's exit status is 0, so a check that reads pytest's status sees the task's own result.
- its own errors are reported as such (``internal_error``): a grader fault, not the agent's.
- the workspace stays off ``sys.path`` while the runner and its plugins import (the grader sets
  ``PYTHONSAFEPATH``); for ``python -m pytest`` the working directory is put back at
  ``pytest_load_initial_conftests``, as Python itself would have done, before any project code loads.
"""

import ast
import hashlib
import hmac
import json
import os
import random
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, Generator, List, Optional, Set, Tuple

import pytest

if TYPE_CHECKING:  # the hooks' types, as strings: pytest.Config and friends are newer than pytest 4.6
    import pluggy

_CONFIG_ENV = "POLAR_GRADER_CONFIG"
BEACON = "polar-grader-beacon"
MIN_PYTEST = (4, 6)
MAX_WALK = 2000  # test files looked at when the run names directories
MAX_FILE = 2000000  # bytes of one test file parsed for canaries
TEST_DIRS = ("test", "tests", "testing")
# the extra assertion of a "fail" copy: a wrong value, the way a real test fails
FAIL_TAILS = ("assert {a} + {b} == {d}", "assert sorted([{b}, {a}]) == [{hi}, {lo}]", "assert len([{a}]) == {b}",
              "assert str({a}) == {b!r}", "assert {{'k': {a}}}.get('k') == {d}")


def seal(key: bytes, data: bytes) -> bytes:
    """XOR with a SHA-256 counter keystream: the plan's names are unreadable in the report file to
    anything without the first key (gone from the process once the plan is written)."""
    stream = b"".join(hashlib.sha256(key + i.to_bytes(8, "big")).digest() for i in range(len(data) // 32 + 1))
    return bytes(a ^ b for a, b in zip(data, stream))


def _key(nodeid: str) -> str:
    """A node id as the plan names tests: ``Class::name`` or ``name``, without parameters (pytest
    spells the file part differently across versions, and as "" for a file outside the rootdir)."""
    return nodeid.partition("::")[2].replace("()::", "").split("[", 1)[0]


def _pytest_version() -> Tuple[int, int]:
    parts = (pytest.__version__.split(".") + ["0"])[:2]
    try:
        return int(parts[0]), int(re.sub(r"\D.*", "", parts[1]) or 0)
    except ValueError:
        return 0, 0


def _load() -> Optional[Dict[str, Any]]:
    path = os.environ.pop(_CONFIG_ENV, None)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config: Dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return config


def _channel(key: bytes, fd: int) -> Callable[[Dict[str, Any]], str]:
    """The one writer of report lines; its key and counter live only in this closure's cell."""
    state: List[Any] = [key, 0]

    def emit(record: Dict[str, Any]) -> str:
        k, seq = state
        record["seq"] = seq
        body = json.dumps(record, sort_keys=True, separators=(",", ":"))
        mac = hmac.new(k, body.encode(), hashlib.sha256).hexdigest()
        state[0] = hashlib.sha256(b"polar-ratchet" + k).digest()
        state[1] = seq + 1
        line = body + "\t" + mac + "\n"
        if fd >= 0:
            os.write(fd, line.encode())
        return line

    return emit


def _start() -> Tuple[Optional[Callable[[Dict[str, Any]], str]], Dict[str, Any]]:
    config = _load()
    if not config:
        return None, {}
    key = bytes.fromhex(config.pop("key"))
    try:
        fd = os.open(config.pop("report"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        fd = -1
    emit = _channel(key, fd)
    _seal.append(hmac.new(key, b"polar-plan", hashlib.sha256).digest())
    supported = _pytest_version() >= MIN_PYTEST
    line = emit({"event": "loaded", "pytest": pytest.__version__, "python": sys.version.split()[0],
                 "supported": supported, "report_open": fd >= 0})
    try:
        os.write(2, "{} {} {}".format(BEACON, config.get("tag", ""), line).encode())
    except OSError:
        pass
    return (emit if supported else None), config


_seal: List[bytes] = []  # the plan's key, dropped once the plan is sealed (before project code loads)
_emit, _config = _start()
_failed = [0, 0, 0]  # [failed reports, of them failing copies', failing copies placed]
_fail_digests: Set[bytes] = set()  # salted digests of the failing copies' names (for the exit status only)
_salt = os.urandom(16)
_pristine: Dict[str, str] = {}  # test files as they were before the copies: put back when pytest ends
_raised: Dict[Tuple[str, str], str] = {}  # (nodeid, phase) -> exception type, for reports that say passed
# (nodeid, phase) -> (the file that raised a skip or xfail, whether it was an xfail() call)
_origins: Dict[Tuple[str, str], Tuple[Optional[str], bool]] = {}
_root = [os.getcwd()]


def _safe(where: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one of our hooks' bodies: our own error is reported as ours (a grader fault), never
    raised into the run."""
    if _emit is None:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the grader must hear of it, the run must go on
        _emit({"event": "internal_error", "where": where, "error": repr(exc)[:500]})
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: "pytest.Config", parser: "pytest.Parser", args: List[str]) -> None:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("pytest.__main__", "pytest") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # what `python -m` adds; kept off until the runner had loaded


# -- the plan: test files, canaries written into them ---------------------------------------------


def _is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _test_files(root: str, args: List[str], wanted: List[str]) -> List[str]:
    """Absolute paths of the test files of this run (and the conftests above them): the grader's own list first, then what the args name."""
    out: List[str] = []
    seen: Set[str] = set()

    def add(path: str) -> None:
        full = os.path.abspath(path)
        if full not in seen and os.path.isfile(full):
            seen.add(full)
            out.append(full)
        parent = os.path.dirname(full)  # the conftests above it: they may mark tests xfail
        while parent.startswith(root) and parent not in seen:
            seen.add(parent)
            conftest = os.path.join(parent, "conftest.py")
            if os.path.isfile(conftest) and conftest not in seen:
                seen.add(conftest)
                out.append(conftest)
            parent = os.path.dirname(parent)

    for w in wanted:
        add(os.path.join(root, w))
    roots = [a.split("::", 1)[0] for a in args if not a.startswith("-")] or ["."]
    for a in roots:
        if os.path.isfile(a):
            add(a)
            continue
        for dirpath, dirnames, filenames in os.walk(a):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in sorted(filenames):
                if len(out) >= MAX_WALK:
                    return out
                if _is_test_file(name) or name == "conftest.py":
                    add(os.path.join(dirpath, name))
    return out


def _decorated_start(node: Any) -> int:
    return int(min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]))


def _ends(body: List[Any], end: int, lines: List[str]) -> Dict[int, int]:
    """Last line of each statement of ``body`` (1-based), without ``end_lineno`` (Python < 3.8)."""
    out = {}
    for i, node in enumerate(body):
        stop = getattr(node, "end_lineno", None)
        if stop is None:
            stop = _decorated_start(body[i + 1]) - 1 if i + 1 < len(body) else end
            while stop > node.lineno and (not lines[stop - 1].strip() or lines[stop - 1].lstrip().startswith("#")):
                stop -= 1
        out[id(node)] = stop
    return out


def _candidates(source: str) -> List[Tuple[str, Optional[str], Any, int]]:
    """(function name, class name or None, node, last line) of the tests a copy can be made of:
    plain ``def test*`` functions and ``Test*`` methods with a body below their def line, no
    skip/xfail decorator, no ``yield``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out: List[Tuple[str, Optional[str], Any, int]] = []

    def usable(node: Any, deco_text: str) -> bool:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            return False
        if re.search(r"skip|xfail|expectedFailure", deco_text) or node.body[0].lineno <= node.lineno:
            return False
        return not any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node))

    def deco(node: Any) -> str:
        return "\n".join(lines[_decorated_start(node) - 1:node.lineno])

    top = _ends(tree.body, len(lines), lines)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and usable(node, deco(node)):
            out.append((node.name, None, node, top[id(node)]))
        elif isinstance(node, ast.ClassDef) and (node.name.startswith("Test") or any(
                "TestCase" in ast.dump(b) for b in node.bases)) and not re.search(r"skip|xfail", deco(node)):
            inner = _ends(node.body, top[id(node)], lines)
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and usable(sub, deco(sub)):
                    out.append((sub.name, node.name, sub, inner[id(sub)]))
    return out


def _plan(sources: Dict[str, bytes], config: Dict[str, Any], named: Dict[str, Set[str]]) -> Dict[str, Any]:
    """Write the canaries into the test files (``sources``: path -> bytes as read); return what was
    placed (``_key`` names). ``named``: for a file the run names by node ids only, the tests it
    names (only those are copied)."""
    rng = random.Random(config["seed"])
    want = int(config.get("canaries", 0))
    prefer = {kind: set(_key(t) for t in config.get(field, [])) for kind, field in (("same", "prefer_same"),
                                                                                   ("fail", "prefer"))}
    words = config["words"]
    pool: List[Tuple[str, str, Optional[str], Any, int]] = []
    texts: Dict[str, str] = {}
    for rel, data in sources.items():
        if not _is_test_file(os.path.basename(rel)):
            continue
        try:
            texts[rel] = data.decode("utf-8")
            found = _candidates(texts[rel])
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for name, cls, node, end in found:
            nodeid = "::".join(([cls] if cls else []) + [name])
            if rel not in named or nodeid in named[rel]:
                pool.append((nodeid, rel, cls, node, end))
    rng.shuffle(pool)
    kinds = ["same", "fail"] * want
    rng.shuffle(kinds)
    chosen = []
    for kind in kinds:  # the task's own tests first (FAIL_TO_PASS for "same", PASS_TO_PASS for "fail")
        left = [p for p in pool if p not in chosen] or pool  # a small suite: copies of one test
        if left:
            chosen.append(left[min(range(len(left)), key=lambda i: (left[i][0] not in prefer[kind], i))])
    placed: List[Dict[str, str]] = []
    edits: Dict[str, List[Tuple[int, List[str]]]] = {}
    taken: Set[str] = set()
    for kind, (nodeid, rel, cls, node, end) in zip(kinds, chosen):
        lines = texts[rel].splitlines(True)
        name = node.name
        new = f"{name}_{rng.choice(words)}"
        while new in taken or re.search(r"\bdef " + re.escape(new) + r"\b", texts[rel]):
            new = f"{name}_{rng.choice(words)}_{rng.randrange(2, 99)}"
        taken.add(new)
        start = _decorated_start(node)
        block = lines[start - 1:end]
        header = re.compile(r"^\s*def\s+" + re.escape(name) + r"\b")  # node.lineno: the first decorator before 3.8
        at = next(i for i, line in enumerate(block) if header.match(line))
        block[at] = re.sub(r"\bdef\s+" + re.escape(name) + r"\b", "def " + new, block[at], count=1)
        if not block[-1].endswith("\n"):
            block[-1] += "\n"
        if kind == "fail":
            body = lines[node.body[0].lineno - 1]
            indent = body[:len(body) - len(body.lstrip())]
            a, b = rng.randrange(2, 1000), rng.randrange(2, 1000)
            tail = rng.choice(FAIL_TAILS).format(a=a, b=b, d=a + b + 1, lo=min(a, b), hi=max(a, b))
            block.append(indent + tail + "\n")
        edits.setdefault(rel, []).append((end, ["\n"] + block))
        copy_id = "::".join(([cls] if cls else []) + [new])
        placed.append({"test": copy_id, "of": nodeid, "file": os.path.basename(rel), "expect": kind})
        if kind == "fail":
            _failed[2] += 1
            _fail_digests.add(hashlib.sha256(_salt + copy_id.encode()).digest())
    for rel, changes in edits.items():
        _pristine[rel] = texts[rel]
        lines = texts[rel].splitlines(True)
        for end, block in sorted(changes, key=lambda c: c[0], reverse=True):
            lines[end:end] = block
        with open(rel, "w", encoding="utf-8") as f:
            f.write("".join(lines))
    return {"placed": placed, "wanted": len(kinds), "candidates": len(pool)}


def _read(files: List[str]) -> Dict[str, bytes]:
    """The run's test files and conftests, each read once (the plan and the xfail check share them)."""
    out = {}
    for path in files:
        try:
            if os.path.getsize(path) <= MAX_FILE:
                with open(path, "rb") as f:
                    out[path] = f.read()
        except OSError:
            continue
    return out


@pytest.hookimpl(trylast=True)
def pytest_configure(config: "pytest.Config") -> None:
    _safe("configure", _configure, config)


def _configure(config: Any) -> None:
    assert _emit is not None
    root = str(getattr(config, "rootdir", None) or os.getcwd())
    _root[0] = root
    args = [str(a) for a in config.args]
    files = _test_files(root, args, list(_config.get("files", [])))
    sources = _read(files)
    static = [os.path.basename(p) for p, data in sources.items() if b"xfail" in data or b"expectedFailure" in data]
    whole = {os.path.abspath(a) for a in args if "::" not in a}
    named: Dict[str, Set[str]] = {}
    for a in args:
        path = os.path.abspath(a.split("::", 1)[0])
        if "::" in a and path not in whole:
            named.setdefault(path, set()).add(_key(a))
    plan = _plan(sources, _config, named)
    for c in plan["placed"]:  # node-id arguments would leave the copies out: name them too
        for arg in args:
            if "::" in arg and _key(arg) == c["of"] and os.path.basename(arg.split("::", 1)[0]) == c["file"]:
                config.args.append(arg.split("::", 1)[0] + "::" + c["test"])
    body = json.dumps({"files": len(files), "xfail_files": static, **plan}, sort_keys=True).encode()
    _emit({"event": "plan", "root": root, "sealed": seal(_seal.pop(), body).hex()})


# -- results ----------------------------------------------------------------------------------------


def _where(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    rel = os.path.relpath(os.path.abspath(str(path)), _root[0])
    return "<outside>" if rel.startswith("..") else rel.replace(os.sep, "/")


def _raiser(tb: Any) -> Optional[str]:
    """The innermost frame of the exception that does not hide itself (``__tracebackhide__``, as
    pytest's ``skip``/``xfail`` do): who raised it, even through a conversion (``unittest.SkipTest``)."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_locals.get("__tracebackhide__") and not frame.f_globals.get("__tracebackhide__"):
            found = frame.f_code.co_filename
        tb = tb.tb_next
    return _where(found)


def _origin(report: Any) -> Optional[str]:
    """The file a skip or xfail was raised from, as the report says it (under xdist, where the
    worker made it): repo-relative, "<outside>" when outside the repo, None when it does not say."""
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return _where(lr[0])
    return _where(getattr(getattr(lr, "reprcrash", None), "path", None))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: "pytest.Item",
                               call: "pytest.CallInfo[None]") -> "Generator[None, pluggy.Result[pytest.TestReport], None]":
    """Outermost: the call's own exception next to the report made of it. A report that says
    passed for a call that raised (other than a skip) was rewritten on the way."""
    raised = getattr(call, "excinfo", None)  # before any other hook converts it (unittest.SkipTest -> skip)
    outcome = yield
    if _emit is None:
        return
    try:
        rep = outcome.get_result()
        excinfo = getattr(call, "excinfo", None)
        if excinfo is not None and rep.outcome == "passed" and getattr(rep, "wasxfail", None) is None:
            _raised[(rep.nodeid, rep.when)] = excinfo.typename
        if raised is not None and rep.outcome == "skipped":
            called = isinstance(raised.value, pytest.xfail.Exception)  # pytest 8 dropped the "reason: " prefix
            _origins[(rep.nodeid, rep.when)] = (_raiser(raised.tb), called)
    except Exception as exc:  # noqa: BLE001 - the grader must hear of it, the run must go on
        _emit({"event": "internal_error", "where": "makereport", "error": repr(exc)[:500]})


def pytest_runtest_logreport(report: "pytest.TestReport") -> None:
    _safe("logreport", _logreport, report)


def _logreport(report: Any) -> None:
    assert _emit is not None
    record: Dict[str, Any] = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    wasxfail = getattr(report, "wasxfail", None)
    here = _origins.pop((report.nodeid, report.when), None)
    if wasxfail is not None:
        called = here[1] if here is not None else str(wasxfail).startswith("reason: ")
        record["xfail"] = "call" if called else "mark"
    if report.skipped or wasxfail is not None:
        record["origin"] = here[0] if here is not None else _origin(report)
    raised = _raised.pop((report.nodeid, report.when), None)
    if raised is not None and report.outcome == "passed":
        record["raised"] = raised
    if report.outcome == "failed":
        _failed[0] += 1
        _failed[1] += hashlib.sha256(_salt + _key(report.nodeid).encode()).digest() in _fail_digests
    _emit(record)


def pytest_collectreport(report: "pytest.CollectReport") -> None:
    _safe("collectreport", _collectreport, report)


def _collectreport(report: Any) -> None:
    assert _emit is not None
    if report.outcome == "failed":
        _failed[0] += 1
        _emit({"nodeid": report.nodeid, "when": "collect", "outcome": "failed"})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: "pytest.Session", config: "pytest.Config", items: "List[pytest.Item]") -> None:
    _safe("collection", _collected, len(items))


def _collected(count: int) -> None:
    assert _emit is not None
    _emit({"event": "collected", "count": count})


def pytest_sessionfinish(session: "pytest.Session", exitstatus: "int | pytest.ExitCode") -> None:
    _safe("sessionfinish", _finish, session, exitstatus)


def pytest_unconfigure(config: "pytest.Config") -> None:
    """The copies leave with the run: a later pytest in the same script meets the suite as it was.
    Best effort, and never a grader fault (the verdict is already written)."""
    while _pristine:
        path, text = _pristine.popitem()
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass


def _finish(session: Any, exitstatus: Any) -> None:
    assert _emit is not None
    status = int(exitstatus)
    if status == 1 and _failed[0] and _failed[0] == _failed[1]:
        session.exitstatus = 0  # only the failing copies failed: the suite's own tests passed
    stopped = bool(getattr(session, "shouldstop", False) or getattr(session, "shouldfail", False))
    _emit({"event": "finish", "exitstatus": status, "placed": _failed[2], "stopped": stopped})
