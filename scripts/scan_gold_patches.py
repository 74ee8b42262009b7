"""Measure the change scan's false positives on real fixes: every gold patch must scan clean.

For each of the eight real SWE instances in ``shared/swe-real`` (``instances.jsonl``: ``patch`` is the
gold diff; ``repos/<instance_id>.tar.gz``: the repository at ``base_commit``, no ``.git``) the repo is
extracted to a temp folder, the gold patch applied (``git apply``, then ``patch -p1``), and
``polar_env.evaluators.scan.scan_change`` run over the changed files' old and new contents; the toy
task's gold fix (``toy__calc-1``) too. Prints a table (instance, changed files, Python files
scanned, findings, scan milliseconds) and the total; exit status 1 when any gold patch has a finding.

``--corpus`` also scans every Python file of each distinct repository whole (every construct
counted, as if the file were new): how often each rule's constructs occur in ordinary library
code, a proxy for the rule's false-positive risk on fixes beyond these eight.

    python scripts/scan_gold_patches.py [--swe-real PATH] [--corpus]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_env.evaluators.scan import PY_SUFFIXES, Finding, scan_change  # noqa: E402

SWE_REAL = ROOT.parent / "shared" / "swe-real"
TOY = "toy__calc-1"


@dataclass
class Row:
    instance: str
    files: int  # paths the gold patch changes
    scanned: int  # of them, Python sources with a new content
    ms: float  # scan_change's time (best of three)
    findings: list[Finding] = field(default_factory=list)


def changed_paths(patch: str) -> list[tuple[str | None, str | None]]:
    """(old path or None for a new file, new path or None for a deleted one) per file of a git diff."""
    out: list[tuple[str | None, str | None]] = []
    for section in re.split(r"(?m)^(?=diff --git )", patch):
        head = re.match(r"diff --git a/(\S+) b/(\S+)", section)
        if head is None:
            continue
        old: str | None = head.group(1)
        new: str | None = head.group(2)
        if re.search(r"(?m)^new file mode", section):
            old = None
        if re.search(r"(?m)^deleted file mode", section):
            new = None
        out.append((old, new))
    return out


def apply_patch(repo: Path, patch: str) -> None:
    patch_file = repo.parent / "gold.diff"
    patch_file.write_text(patch)
    tries = (["git", "apply", "--whitespace=nowarn", str(patch_file)], ["patch", "-p1", "--batch", "-i", str(patch_file)])
    errors = []
    for cmd in tries:
        res = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
        if res.returncode == 0:
            return
        errors.append(f"{cmd[0]}: {res.stderr.strip() or res.stdout.strip()}")
    raise RuntimeError("the gold patch does not apply: " + "; ".join(errors))


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def scan_patch(instance: str, repo: Path, patch: str) -> Row:
    """Apply ``patch`` in ``repo`` (changed in place) and scan what it changed."""
    paths = changed_paths(patch)
    old = {o: _read(repo / o) for o, _ in paths if o is not None}
    apply_patch(repo, patch)
    files = [(n or o or "", old.get(o) if o is not None else None, _read(repo / n) if n is not None else None)
             for o, n in paths]
    times = []
    for _ in range(3):  # the best of three: the machine may be shared
        start = time.perf_counter()
        findings = scan_change(files)
        times.append((time.perf_counter() - start) * 1000)
    ms = min(times)
    scanned = sum(1 for p, _, new in files if new is not None and p.casefold().endswith(PY_SUFFIXES))
    return Row(instance, len(files), scanned, ms, findings)


def extract(tarball: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    return dest


def gold_rows(swe_real: Path, work: Path) -> list[Row]:
    """One row per instance of ``swe_real``, each repo extracted under ``work``."""
    rows = []
    for line in (swe_real / "instances.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        inst = json.loads(line)
        iid = inst["instance_id"]
        repo = extract(swe_real / "repos" / f"{iid}.tar.gz", work / iid / "repo")
        rows.append(scan_patch(iid, repo, inst["patch"]))
    return rows


def toy_row(work: Path) -> Row:
    from polar_env.tasks.toy import toy_tasks

    task = toy_tasks(work / "toy-cache", ids=[TOY])[0]
    assert task.repo_dir is not None and task.patch
    repo = work / TOY / "repo"
    shutil.copytree(task.repo_dir, repo, ignore=shutil.ignore_patterns(".git"))
    return scan_patch(TOY, repo, task.patch)


def corpus(swe_real: Path, work: Path) -> tuple[Counter[str], Counter[str], int]:
    """Per rule: hits and files over every Python file of each distinct repository (whole files)."""
    hits: Counter[str] = Counter()
    files: Counter[str] = Counter()
    seen: set[str] = set()
    total = 0
    for line in (swe_real / "instances.jsonl").read_text().splitlines():
        inst = json.loads(line) if line.strip() else None
        if inst is None or inst["repo"] in seen:
            continue
        seen.add(inst["repo"])
        repo = work / inst["instance_id"] / "repo"
        if not repo.is_dir():
            repo = extract(swe_real / "repos" / f"{inst['instance_id']}.tar.gz", repo)
        for path in sorted(repo.rglob("*")):
            rel = path.relative_to(repo).as_posix()
            if not path.is_file() or not rel.casefold().endswith(PY_SUFFIXES):
                continue
            found = scan_change([(rel, None, path.read_bytes())])  # a new file: every construct counts
            total += 1
            hits.update(f.rule for f in found)
            files.update({f.rule for f in found})
            for f in found:
                print(f"  corpus {inst['repo']}/{rel}:{f.line} {f.rule} {f.detail}", file=sys.stderr)
    return hits, files, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swe-real", type=Path, default=SWE_REAL)
    parser.add_argument("--corpus", action="store_true", help="also count each rule over whole repositories")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="scan-gold-") as tmp:
        work = Path(tmp)
        rows = [*gold_rows(args.swe_real, work), toy_row(work)]
        print(f"{'instance':40} {'files':>5} {'scanned':>7} {'findings':>8} {'ms':>8}")
        for r in rows:
            print(f"{r.instance:40} {r.files:5d} {r.scanned:7d} {len(r.findings):8d} {r.ms:8.1f}")
            for f in r.findings:
                print(f"    {f.path}:{f.line} {f.rule} {f.detail}")
        total = sum(len(r.findings) for r in rows)
        print(f"total: {len(rows)} gold patches, {sum(r.scanned for r in rows)} Python files scanned, {total} findings")
        if args.corpus:
            hits, files, n = corpus(args.swe_real, work)
            print(f"\ncorpus: {n} Python files of the distinct repositories, scanned whole")
            print(f"{'rule':20} {'files':>5} {'hits':>5}")
            for rule, count in sorted(files.items(), key=lambda kv: -kv[1]):
                print(f"{rule:20} {count:5d} {hits[rule]:5d}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
