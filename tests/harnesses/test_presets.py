"""Harness presets as data: the table, rendering, user-defined harnesses, installs and runtime binds.
All offline: installs are exercised with a fake ``npm`` and a stubbed pip step."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from polar_env.engines.embedded.policy import FinishingPolicy, ScriptedPolicy
from polar_env.errors import ConfigError
from polar_env.harnesses import (
    HARNESSES,
    ClientSpec,
    HarnessSpec,
    Install,
    ensure_installed,
    get_harness,
    harness_from_dict,
    is_installed,
    load_harness_file,
    render,
)
from polar_env.harnesses import install as install_mod
from polar_env.harnesses.clients import CLIENTS, VERSIONS, get
from polar_env.harnesses.launch import NODE_BIN_DIR, harness_mounts, with_harness
from polar_env.harnesses.scripted import is_finish_call, policy_for
from polar_env.records import ProviderAPI
from polar_env.runtimes.base import RuntimeSpec

REPO = Path(__file__).resolve().parents[2]
CAPTURED = REPO / "tests" / "fixtures" / "providers" / "captured"
VALUES = {"base_url": "http://127.0.0.1:8400", "key": 'k"ey', "model": "m", "home": "/h", "prompt": "fix the bug"}


def test_table_names_and_defaults() -> None:
    assert list(HARNESSES) == ["codex", "claude_code", "gemini_cli", "qwen_code", "opencode", "pi", "mini_swe_agent"]
    assert set(HARNESSES["pi"].apis) == {ProviderAPI.OPENAI_CHAT, ProviderAPI.OPENAI_RESPONSES, ProviderAPI.ANTHROPIC, ProviderAPI.GEMINI}
    for h in HARNESSES.values():
        assert h.default_api in h.apis
        assert h.argv[0] == h.binary
        assert "{prompt}" in h.argv or "{prompt_words}" in h.argv
        assert h.quiet_env.get("HOME") == "{home}"
        assert get_harness(h.name) is h and get_harness(h.cli) is h
    assert HARNESSES["mini_swe_agent"].install == Install("pip", "mini-swe-agent", "2.4.6", binary="mini", dir="mini")
    assert HARNESSES["mini_swe_agent"].finish_command == "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def test_clients_are_derived_from_presets() -> None:
    ids = sorted(c.id for c in CLIENTS.values())
    assert ids == ["claude-anthropic", "codex-openai_responses", "gemini-gemini", "mini-openai_chat",
                   "opencode-openai_chat", "pi-anthropic", "pi-gemini", "pi-openai_chat", "pi-openai_responses",
                   "qwen-openai_chat"]
    # every spec that was captured against a real CLI still exists under the same id
    for folder in CAPTURED.iterdir():
        assert folder.name in ids
    assert get("qwen") == HARNESSES["qwen_code"].client()
    assert get("pi", "anthropic").install is HARNESSES["pi"].install
    assert VERSIONS["pi"] == "@mariozechner/pi-coding-agent@0.73.1"
    with pytest.raises(KeyError):
        get("pi")  # four apis: ambiguous


@pytest.mark.parametrize("client", list(CLIENTS.values()), ids=lambda c: c.id)
def test_every_client_renders(client: ClientSpec) -> None:
    argv, env, files = render(client, **VALUES)
    text = json.dumps([argv, env, files])
    for name in ("base_url", "key", "model", "home", "prompt"):
        assert "{" + name + "}" not in text
    assert env["HOME"] == "/h"
    assert "fix the bug" in argv or argv[-3:] == ["fix", "the", "bug"]
    # the key reaches the CLI through env (never argv) and config values are escaped
    assert 'k"ey' in env.values() and all('k"ey' not in a for a in argv)
    for path, content in files.items():
        if path.endswith(".json"):
            json.loads(content)


def test_pi_modes_and_codex_config() -> None:
    _, _, files = render(get("pi", "gemini"), **VALUES)
    provider = json.loads(files[".pi/agent/models.json"])["providers"]["polar"]
    assert provider["baseUrl"] == "http://127.0.0.1:8400/v1beta" and provider["api"] == "google-generative-ai"
    _, env, files = render(get("codex"), **VALUES)
    assert 'base_url = "http://127.0.0.1:8400/v1"' in files[".codex/config.toml"]
    assert env["CODEX_HOME"] == "/h/.codex"


def test_spec_validation() -> None:
    pi = HARNESSES["pi"]
    with pytest.raises(ConfigError, match="does not speak"):
        HARNESSES["codex"].client("openai_chat")
    with pytest.raises(ConfigError, match="default_api"):
        HarnessSpec(name="x", cli="x", install=pi.install, apis={}, default_api=ProviderAPI.OPENAI_CHAT, argv=("x",))
    with pytest.raises(ConfigError, match="unattended_flags"):
        HarnessSpec(name="x", cli="x", install=pi.install, apis=pi.apis, default_api=pi.default_api, argv=("x",),
                    unattended_flags=("--yolo",))


# -- user-defined harnesses ----------------------------------------------------------------------

USER = {
    "name": "my-agent",
    "command": "my-agent --model {model} --task {prompt}",
    "install": {"kind": "npm", "package": "@me/my-agent", "version": "1.2.3"},
    "api": "openai_chat",
    "env": {"OPENAI_BASE_URL": "{base_url}/v1", "OPENAI_API_KEY": "{key}", "MY_AGENT_TELEMETRY": False},
    "files": {".my-agent/config.json": '{"model": "{model}", "base": "{base_url}"}'},
}


def test_user_harness_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "my-agent.json"
    path.write_text(json.dumps(USER))
    h = get_harness(str(path))
    assert h.name == h.cli == "my-agent" and h.install.requirement == "@me/my-agent@1.2.3"
    argv, env, files = render(h.client(), **VALUES)
    assert argv == ["my-agent", "--model", "m", "--task", "fix the bug"]
    assert env == {"OPENAI_BASE_URL": "http://127.0.0.1:8400/v1", "OPENAI_API_KEY": 'k"ey',
                   "MY_AGENT_TELEMETRY": "false", "HOME": "/h"}
    assert json.loads(files[".my-agent/config.json"]) == {"model": "m", "base": "http://127.0.0.1:8400"}


def test_user_harness_from_yaml_file(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="pyyaml (a core dependency) is missing: pip install -e .")
    path = tmp_path / "agent.yaml"
    path.write_text(
        "name: yagent\n"
        "command: [yagent, run, '{prompt_words}']\n"
        "apis: [openai_chat, anthropic]\n"
        "api: anthropic\n"
        "env: {ANTHROPIC_BASE_URL: '{base_url}', ANTHROPIC_API_KEY: '{key}'}\n"
        "needs: none\n"
    )
    h = load_harness_file(path)
    assert h.install.kind == "path" and h.default_api is ProviderAPI.ANTHROPIC and len(h.apis) == 2
    argv, _, _ = render(h.client(), **VALUES)
    assert argv == ["yagent", "run", "fix", "the", "bug"]


def _factory() -> HarnessSpec:
    return harness_from_dict({**USER, "name": "from-factory"})


FROM_MODULE = harness_from_dict({**USER, "name": "from-module"})


def test_user_harness_from_import_path() -> None:
    assert get_harness(f"{__name__}:FROM_MODULE") is FROM_MODULE
    assert get_harness(f"{__name__}:_factory").name == "from-factory"
    with pytest.raises(ConfigError, match="cannot import"):
        get_harness(f"{__name__}:nope")


@pytest.mark.parametrize(("change", "match"), [
    ({"name": "bad name"}, "'name'"),
    ({"command": ["x"]}, "never uses"),
    ({"api": "smoke signals"}, "provider API name"),  # a registered name is checked where it is chosen
    ({"install": {"kind": "apt", "package": "x"}}, "npm or pip"),
    ({"surprise": 1}, "unknown keys"),
    ({"needs": "java"}, "needs"),
])
def test_user_harness_errors(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        harness_from_dict({**USER, **change})


def test_unknown_harness() -> None:
    with pytest.raises(ConfigError, match="unknown harness"):
        get_harness("no_such_harness")


# -- installs ------------------------------------------------------------------------------------


def _fake_npm(bin_dir: Path, log: Path) -> None:
    """An ``npm`` that records its argv and creates ``node_modules/.bin/<binary>`` under --prefix."""
    script = bin_dir / "npm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "prefix = sys.argv[sys.argv.index('--prefix') + 1]\n"
        "os.makedirs(os.path.join(prefix, 'node_modules', '.bin'), exist_ok=True)\n"
        "path = os.path.join(prefix, 'node_modules', '.bin', 'my-agent')\n"
        "open(path, 'w').write('#!/bin/sh\\n')\n"
        "os.chmod(path, 0o755)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_npm_install_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "npm.log"
    _fake_npm(bin_dir, log)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    h = harness_from_dict(USER)
    cache = tmp_path / "cache"
    assert not is_installed(h, cache)
    binary = ensure_installed(h, cache, log=False)
    assert binary == cache / "my-agent" / "node_modules" / ".bin" / "my-agent"
    assert (cache / "my-agent" / ".polar-installed").read_text().strip() == "@me/my-agent@1.2.3"
    assert log.read_text().split() == ["install", "--prefix", str(cache / "my-agent"), "--no-audit", "--no-fund",
                                       "--loglevel=error", "@me/my-agent@1.2.3"]
    assert ensure_installed(h, cache, log=False) == binary
    assert len(log.read_text().splitlines()) == 1  # the second call installed nothing
    # a different pinned version is a reinstall
    newer = harness_from_dict({**USER, "install": {**USER["install"], "version": "1.2.4"}})
    assert not is_installed(newer, cache)
    ensure_installed(newer, cache, log=False)
    assert len(log.read_text().splitlines()) == 2


def test_pip_install_builds_a_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], install: Install) -> None:
        calls.append(argv)
        if argv[1:3] == ["-m", "pip"]:
            binary = Path(argv[0]).parent / install.binary
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
        else:  # python -m venv DIR
            (Path(argv[-1]) / "bin").mkdir(parents=True)
            (Path(argv[-1]) / "bin" / "python").write_text("")

    monkeypatch.setattr(install_mod, "_run", fake_run)
    h = HARNESSES["mini_swe_agent"]
    binary = ensure_installed(h, tmp_path, log=False)
    venv = tmp_path / "mini" / "venv"
    assert binary == venv / "bin" / "mini"
    assert calls == [[sys.executable, "-m", "venv", str(venv)],
                     [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                      "mini-swe-agent==2.4.6"]]
    ensure_installed(h, tmp_path, log=False)
    assert len(calls) == 2


def test_installed_presets_need_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever is installed in the real cache comes back without running anything."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ensure_installed ran an install for an installed harness")

    monkeypatch.setattr(install_mod, "_run", refuse)
    for h in HARNESSES.values():
        if is_installed(h):
            assert ensure_installed(h) == install_mod.binary_path(h)


def test_path_harness_is_never_installed(tmp_path: Path) -> None:
    h = harness_from_dict({"name": "sh-agent", "command": ["sh", "-c", "{prompt}"]})
    assert h.install.kind == "path" and is_installed(h, tmp_path)
    assert ensure_installed(h, tmp_path).name == "sh"
    missing = harness_from_dict({"name": "nope", "command": ["/no/such/agent", "{prompt}"]})
    with pytest.raises(ConfigError, match="never installed"):
        ensure_installed(missing, tmp_path)


# -- runtime binds -------------------------------------------------------------------------------


def _stamp(cache: Path, install: Install, binary: Path) -> None:
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (install.prefix(cache) / ".polar-installed").write_text(install.requirement + "\n")


def test_mounts_for_npm_and_pip(tmp_path: Path) -> None:
    pi = HARNESSES["pi"]
    with pytest.raises(ConfigError, match="not installed"):
        harness_mounts(pi, tmp_path)
    _stamp(tmp_path, pi.install, pi.install.binary_path(tmp_path))
    node = tmp_path / "node"
    node.write_text("")
    m = harness_mounts(pi, tmp_path, node=node)
    assert m.binds == ((tmp_path / "pi", "/opt/polar/harnesses/pi"), (node, f"{NODE_BIN_DIR}/node"))
    assert m.binary == "/opt/polar/harnesses/pi/node_modules/.bin/pi"
    assert m.path == ("/opt/polar/harnesses/pi/node_modules/.bin", NODE_BIN_DIR)

    mini = HARNESSES["mini_swe_agent"]
    venv = tmp_path / "mini" / "venv"
    _stamp(tmp_path, mini.install, venv / "bin" / "mini")
    (venv / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\n")
    m = harness_mounts(mini, tmp_path)
    prefix = (tmp_path / "mini").resolve()
    assert m.binds == ((prefix, str(prefix)), (Path(sys.base_prefix).resolve(), str(Path(sys.base_prefix).resolve())))
    assert m.binary == str(prefix / "venv" / "bin" / "mini")

    spec = with_harness(RuntimeSpec(binds=[(node, f"{NODE_BIN_DIR}/node")]), pi, tmp_path, node=node)
    assert [dst for _src, dst in spec.binds] == [f"{NODE_BIN_DIR}/node", "/opt/polar/harnesses/pi"]


# -- scripted policies ---------------------------------------------------------------------------

BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def test_finishing_policy_for_mini() -> None:
    assert type(policy_for(HARNESSES["pi"])) is ScriptedPolicy
    policy = policy_for(HARNESSES["mini_swe_agent"])
    assert isinstance(policy, FinishingPolicy)
    first = policy.next_turn([{"role": "user", "content": "go"}], BASH)
    assert first["tool_calls"][0]["function"]["arguments"] == {"command": "echo hi"}
    done = policy.next_turn([{"role": "user", "content": "go"}, {"role": "assistant", "content": ""},
                             {"role": "tool", "content": "hi"}], BASH)
    assert done["content"] == "The command printed: hi"
    args = done["tool_calls"][0]["function"]["arguments"]
    assert args == {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}
    assert is_finish_call(json.dumps(args), HARNESSES["mini_swe_agent"].finish_command)
    assert not is_finish_call('{"command": "ls"}', HARNESSES["mini_swe_agent"].finish_command)
    assert not is_finish_call(json.dumps(args), None)
