"""The agent's workdir holds its base commit and nothing after it (``polar_env/runtimes/history.py``).

A repo with history past its base in every place git keeps it (branches, an annotated tag, a
remote-tracking ref, the stash, reflogs, packed-refs, packed and loose objects, a dangling commit,
FETCH_HEAD/ORIG_HEAD, an alternates file naming another object store, bound read-only into the
runtime) is checked out at the base; a real runtime is prepared from it and every git command that
could name a dropped object is tried inside. The same probes, run on a host copy that still has the
history, find every dropped object, so they can fail. The no-op and failure cases run the script on
the host."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar_env.runtimes.history import SCRUB_HISTORY
from tests.runtimes.conftest import git

ALT_INSIDE = "/opt/polar-alt/objects"  # where the other object store is bound in the runtime
LISTING = (
    "git log --all --reflog --format='%H %T %P'; git rev-list --all --reflog --objects; git for-each-ref; "
    "git show-ref; git stash list --format=%H; git reflog --all; git fsck --unreachable --lost-found --no-reflogs; "
    "git cat-file --batch-all-objects --batch-check; git count-objects -v; "
    "cat .git/packed-refs .git/FETCH_HEAD .git/ORIG_HEAD .git/objects/info/alternates; true"
)


@dataclass
class History:
    repo: Path
    alt_objects: Path  # the other object store (bound at ALT_INSIDE)
    base: str
    kept: set[str]  # the base commit, its trees and blobs
    dropped: set[str]  # every other object, the alternate store's included
    future: dict[str, str]  # name -> id, for the messages


def sh(cwd: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", "-c", script], cwd=cwd, capture_output=True, text=True, check=False)


def new_repo(path: Path) -> Path:
    """An empty git repository at ``path``."""
    path.mkdir()
    git(path, "init", "-q")
    return path


def commit(repo: Path, message: str, **files: str) -> str:
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def object_ids(repo: Path, *args: str) -> set[str]:
    return {line.split()[0] for line in git(repo, *args).splitlines() if line}


def make_history(tmp_path: Path) -> History:
    alt = tmp_path / "alt"
    new_repo(alt)
    alt_commit = commit(alt, "only in the other store", **{"alt.txt": "the fix, elsewhere\n"})
    repo = tmp_path / "repo"
    new_repo(repo)
    commit(repo, "before the base", **{"calc.py": "def add(a, b):\n    return a - b\n", "f.txt": "0\n"})
    base = commit(repo, "base", **{"f.txt": "1\n", ".gitignore": "*.log\n"})
    fix = commit(repo, "the fix", **{"calc.py": "def add(a, b):\n    return a + b\n"})
    later = commit(repo, "later", **{"f.txt": "3\n"})
    git(repo, "tag", "-a", "v2", "-m", "release")
    git(repo, "checkout", "-q", "-b", "feature")
    feature = commit(repo, "feature", **{"f.txt": "4\n"})
    git(repo, "checkout", "-q", "main")
    git(repo, "update-ref", "refs/remotes/origin/main", later)
    git(repo, "repack", "-adq")
    git(repo, "pack-refs", "--all")
    tree = git(repo, "write-tree").strip()
    dangling = git(repo, "commit-tree", "-p", later, "-m", "dangling", tree).strip()
    (repo / ".git" / "FETCH_HEAD").write_text(f"{later}\t\tbranch 'main' of https://example.invalid/repo\n")
    git(repo, "reset", "-q", "--hard", base)  # ORIG_HEAD: later; the reflog keeps them all
    (repo / "f.txt").write_text("stashed\n")
    git(repo, "stash", "-q")
    stash = git(repo, "rev-parse", "refs/stash").strip()
    alt_objects = alt / ".git" / "objects"
    (repo / ".git" / "objects" / "info" / "alternates").write_text(f"{ALT_INSIDE}\n")
    probe = tmp_path / "probe"  # the repo as git sees it with the alternate store where it is on the host
    shutil.copytree(repo, probe, symlinks=True)
    (probe / ".git" / "objects" / "info" / "alternates").write_text(f"{alt_objects}\n")
    every = object_ids(probe, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
    kept = object_ids(repo, "rev-list", "--objects", "--no-walk", base)
    future = {"fix": fix, "later": later, "feature": feature, "dangling": dangling, "stash": stash, "alt": alt_commit,
              "tag": git(repo, "rev-parse", "v2").strip(), "fixed blob": git(repo, "rev-parse", f"{fix}:calc.py").strip()}
    assert set(future.values()) <= every and kept < every
    history = History(repo, alt_objects, base, kept, every - kept, future)
    # the probes can fail: on the copy that still has the history they name every dropped object
    listed = sh(probe, LISTING).stdout
    assert all(oid in listed for oid in history.dropped), history.dropped - {o for o in history.dropped if o in listed}
    assert sh(probe, f"git cat-file -e {alt_commit} && git cat-file -e {dangling} && git show -s {fix}").returncode == 0
    return history


def leaks(text: str, history: History) -> list[str]:
    return sorted(oid for oid in history.dropped if oid[:10] in text)


@pytest.mark.parametrize("variant", ["sandbox-host", "sandbox-rootfs", pytest.param("docker", marks=pytest.mark.slow)])
async def test_no_git_command_reaches_past_the_base(runtimes: Any, variant: str, tmp_path: Path) -> None:
    history = make_history(tmp_path)
    rt = await runtimes(source_dir=history.repo, binds=[(history.alt_objects, ALT_INSIDE)])
    assert (await rt.exec(f"ls -A {ALT_INSIDE} | grep -q .")).exit_code == 0  # the other store is still there
    listed = await rt.exec(LISTING)
    assert not leaks(listed.output, history), listed.output
    ids = " ".join(sorted(history.dropped))
    tried = await rt.exec(f"for id in {ids}; do git cat-file -e $id 2>/dev/null && echo LEAK $id; "
                          "git show $id >/dev/null 2>&1 && echo LEAK $id; done; echo done")
    assert tried.output.strip() == "done", tried.output
    state = await rt.exec("git rev-parse HEAD; git symbolic-ref HEAD; git for-each-ref --format='%(refname)'; "
                          "git count-objects -v; git stash list; git status --porcelain; ls -A .git")
    lines = state.output.splitlines()
    assert lines[:3] == [history.base, "refs/heads/main", "refs/heads/main"], state.output
    assert "count: 0" in lines and f"in-pack: {len(history.kept)}" in lines, state.output
    assert not any(line.startswith("alternate:") for line in lines), state.output
    assert sorted(lines[lines.index("size-garbage: 0") + 1:]) == ["HEAD", "config", "index", "info", "objects", "refs", "shallow"]
    no_parent = await rt.exec("git rev-parse -q --verify HEAD~1")
    assert no_parent.exit_code != 0 and not no_parent.output.strip()
    assert await rt.diff() == ""
    await rt.write_file("/testbed/calc.py", b"def add(a, b):\n    return b + a\n")
    patch = await rt.diff()
    assert "+    return b + a" in patch and "-    return a - b" in patch
    # what grading does in the same kind of runtime: reset files to base_commit, then re-apply
    await rt.write_file("/tmp/agent.patch", patch.encode())
    graded = await rt.exec(f"git checkout {history.base} -- calc.py && git status --porcelain && "
                           "git apply --3way /tmp/agent.patch && git reset -q && echo applied")
    assert graded.exit_code == 0 and graded.output.splitlines() == ["Applied patch to 'calc.py' cleanly.", "applied"], graded.output
    assert await rt.diff() == patch


def scrub(repo: Path) -> subprocess.CompletedProcess[str]:
    return sh(repo, SCRUB_HISTORY)


def refs(repo: Path) -> str:
    return git(repo, "for-each-ref")


def test_detached_head_stays_detached_and_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    new_repo(repo)
    base = commit(repo, "base", **{"a.txt": "a\n"})
    commit(repo, "future", **{"a.txt": "b\n"})
    git(repo, "checkout", "-q", "--detach", base)
    assert scrub(repo).returncode == 0
    assert git(repo, "rev-parse", "HEAD").strip() == base and refs(repo) == ""
    assert subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=repo, check=False).returncode == 1
    assert git(repo, "log", "--all", "--format=%H").split() == [base]


@pytest.mark.parametrize("kind", ["no .git", "gitdir link", "unborn HEAD"])
def test_nothing_to_scrub_is_a_no_op(tmp_path: Path, kind: str) -> None:
    store = tmp_path / "store"
    new_repo(store)
    commit(store, "history", **{"a.txt": "a\n"})
    work = tmp_path / "work"
    work.mkdir()
    if kind == "gitdir link":
        git(store, "worktree", "add", "-q", str(work / "wt"))
        work = work / "wt"
    elif kind == "unborn HEAD":
        git(work, "init", "-q")
        git(work, "fetch", "-q", str(store), "main:refs/remotes/origin/main")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    res = scrub(work)
    assert res.returncode == 0 and res.stderr == ""
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if kind == "unborn HEAD":
        assert "refs/remotes/origin/main" in refs(work)


def test_a_failure_leaves_the_repo_as_it_was(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    new_repo(repo)
    base = commit(repo, "base", **{"a.txt": "a\n", "b.txt": "b\n"})
    future = commit(repo, "future", **{"a.txt": "c\n"})
    git(repo, "reset", "-q", "--hard", base)
    blob = git(repo, "rev-parse", f"{base}:b.txt").strip()
    (repo / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # HEAD's tree cannot be packed
    res = scrub(repo)
    assert res.returncode == 1 and "history is not dropped" in res.stderr
    assert git(repo, "rev-parse", "ORIG_HEAD").strip() == future and not (repo / ".git" / "polar-scrub").exists()


def test_submodule_checkout_loses_its_link_not_its_files(tmp_path: Path) -> None:
    sub = tmp_path / "sub"
    new_repo(sub)
    commit(sub, "sub", **{"s.txt": "s\n"})
    repo = tmp_path / "repo"
    new_repo(repo)
    commit(repo, "base", **{"a.txt": "a\n"})
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "vendored")
    git(repo, "commit", "-q", "-m", "with the submodule")
    assert (repo / ".git" / "modules").is_dir() and (repo / "vendored" / ".git").is_file()
    assert scrub(repo).returncode == 0
    assert not (repo / ".git" / "modules").exists() and not (repo / "vendored" / ".git").exists()
    assert (repo / "vendored" / "s.txt").read_text() == "s\n"
    assert git(repo, "status", "--porcelain") == ""
    (repo / "a.txt").write_text("b\n")
    assert "a.txt" in git(repo, "diff")
