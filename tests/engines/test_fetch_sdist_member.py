"""scripts/fetch_sdist_member.py against a local simple index (JSON and HTML pages): the member
comes out of the tarball, and a sdist or member that is not the pinned one is refused."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_sdist_member.py"
MEMBER = "demo-1.0/templates/chat.jinja"
TEMPLATE = b"{{ messages }}\n"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_sdist_member", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sdist_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(MEMBER)
        info.size = len(TEMPLATE)
        tar.addfile(info, io.BytesIO(TEMPLATE))
    return buf.getvalue()


@pytest.fixture(params=["json", "html"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A simple index on 127.0.0.1 listing demo-1.0.tar.gz; yields (index URL, sdist sha256)."""
    data = sdist_bytes()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "demo-1.0.tar.gz").write_bytes(data)
    page = tmp_path / "simple" / "demo"
    page.mkdir(parents=True)
    if request.param == "json":
        body = json.dumps({"files": [{"filename": "demo-1.0.tar.gz", "url": "../../files/demo-1.0.tar.gz"}]})
        (page / "index.json").write_text(body)
    else:
        (page / "index.html").write_text('<html><body><a href="../../files/demo-1.0.tar.gz#sha256=x">demo-1.0.tar.gz</a></body></html>')

    class Handler(SimpleHTTPRequestHandler):
        def translate_path(self, path: str) -> str:
            local = Path(super().translate_path(path))
            return str(local / "index.json") if (local / "index.json").is_file() else str(local)

        def guess_type(self, path: str) -> str:  # type: ignore[override]
            return "application/vnd.pypi.simple.v1+json" if str(path).endswith(".json") else super().guess_type(path)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", hashlib.sha256(data).hexdigest()
    finally:
        server.shutdown()
        server.server_close()


def run(script: ModuleType, out: Path, sdist_sha: str, member_sha: str) -> int:
    status: int = script.main(["--project", "demo", "--filename", "demo-1.0.tar.gz", "--sha256", sdist_sha,
                               "--member", MEMBER, "--member-sha256", member_sha, "--out", str(out)])
    return status


def test_member_comes_out_of_the_pinned_sdist(index: tuple[str, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url, sha = index
    monkeypatch.setenv("PIP_INDEX_URL", url)
    script = load_script()
    out = tmp_path / "chat.jinja"
    assert run(script, out, sha, hashlib.sha256(TEMPLATE).hexdigest()) == 0
    assert out.read_bytes() == TEMPLATE
    with pytest.raises(SystemExit, match="is not the pinned"):
        run(script, tmp_path / "bad.jinja", sha, "0" * 64)
    with pytest.raises(SystemExit, match="is not the pinned"):
        run(script, tmp_path / "bad2.jinja", "0" * 64, hashlib.sha256(TEMPLATE).hexdigest())
    assert not (tmp_path / "bad.jinja").exists() and not (tmp_path / "bad2.jinja").exists()
