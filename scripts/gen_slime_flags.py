#!/usr/bin/env python3
"""Regenerate polar_env/integrations/slime_flags.txt from the real argparse parsers.

slime hands every flag it does not know to Megatron's parser with ``ignore_unknown_args=True``,
so a misspelt flag in a recipe is dropped silently; ``polar-env slime-args`` checks names against
this list instead. The list is what the parsers themselves register, nothing scraped from scripts:

- Megatron-LM: ``megatron.training.arguments.add_megatron_arguments``, at the commit slime's image
  builds (``ARG MEGATRON_COMMIT`` in slime's ``docker/Dockerfile``) with slime's
  ``docker/patch/latest/megatron*.patch`` applied, as the image does (the patch adds flags the
  model presets use, e.g. ``--use-gated-attention``);
- slime: its early parser (``_pre_parse_mode``: ``--train-backend``, ``--debug-*``), its extra-args
  provider (``slime.utils.arguments.get_slime_extra_args_provider``) and its
  SGLang/router parser (``slime.backends.sglang_utils.arguments.add_sglang_arguments``: SGLang's
  ``ServerArgs.add_cli_args`` under ``--sglang-`` minus the flags slime sets itself, plus
  ``RouterArgs.add_cli_args`` under ``--router-``).

The parsers are built by importing those modules from the checkouts given (and SGLang /
sglang-router from a directory holding their unpacked wheels or source, ``--sglang``). Modules
the parser code imports but never uses to define flags (torch extensions, triton, CUDA libraries)
are replaced by inert stand-ins when they are not installed; the flag definitions are the
projects' own. Usage::

    python scripts/gen_slime_flags.py --slime ~/src/slime --megatron ~/src/Megatron-LM \\
        --sglang ~/src/sglang-site [--out polar_env/integrations/slime_flags.txt]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "polar_env" / "integrations" / "slime_flags.txt"
OWN = ("slime", "slime_plugins", "megatron", "sglang", "sglang_router")
# Imports that define how flags are declared (SGLang's ServerArgs is a msgspec.Struct whose
# annotated fields become flags): a stand-in would silently drop flags, so these must be real.
REQUIRED = {"msgspec": "pip install msgspec"}
# torch probes for triton and compiles against it when it imports: torch's (cached) probe runs
# before any stand-in exists, so it settles that triton is absent.
# Flags every real build must contain; a list without them means a parser was not really read.
ANCHORS = ("tensor-model-parallel-size", "rollout-batch-size", "custom-generate-function-path",
           "sglang-mem-fraction-static", "router-policy")


class _Inert(types.ModuleType):
    """A module whose every attribute is an inert object (class, decorator, value at once)."""

    __path__: list[str] = []
    __version__ = "0.0.0"  # version checks at import time compare against this

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything


class _AnythingMeta(type):
    def __new__(mcs, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kwargs: Any) -> Any:
        return super().__new__(mcs, name, bases, ns)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything

    def __getitem__(cls, item: Any) -> Any:
        return _Anything

    def __or__(cls, other: Any) -> Any:
        return _Anything

    def __ror__(cls, other: Any) -> Any:
        return _Anything

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: keep the function
        return _Anything


class _Anything(metaclass=_AnythingMeta):
    def __init_subclass__(cls, **kwargs: Any) -> None:  # e.g. msgspec.Struct's frozen=True
        return None


class _StubMissing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: a module of ``self.stubbed`` (third-party packages found missing
    while importing the parsers) that nothing else can find becomes an ``_Inert`` one. Never
    the projects whose parsers we read, never the standard library."""

    def __init__(self) -> None:
        self.stubbed: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in self.stubbed:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Inert(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _commit(path: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()[:12]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def megatron_tree(slime: Path, megatron: Path, out: Path) -> str:
    """Megatron's ``megatron/`` at slime's pinned commit with slime's patches, written to ``out``;
    returns the commit."""
    dockerfile = (slime / "docker" / "Dockerfile").read_text()
    match = re.search(r"^ARG MEGATRON_COMMIT=([0-9a-f]{7,40})", dockerfile, re.MULTILINE)
    if match is None:
        raise SystemExit(f"{slime}/docker/Dockerfile pins no MEGATRON_COMMIT")
    commit = match.group(1)
    archive = subprocess.run(["git", "-C", str(megatron), "archive", commit, "megatron"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"{megatron} has no commit {commit[:12]} (slime's pin): git -C {megatron} fetch origin {commit}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    for patch in sorted((slime / "docker" / "patch" / "latest").glob("megatron*.patch")):
        applied = subprocess.run(["git", "apply", "--include=megatron/*", str(patch)], cwd=out, capture_output=True,
                                 text=True, check=False)
        if applied.returncode != 0:
            raise SystemExit(f"{patch.name} does not apply to Megatron {commit[:12]}: {applied.stderr.strip()[:300]}")
    return commit[:12]


def flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long option names a parser accepts, without dashes (``--a-b`` → ``a-b``)."""
    return {opt[2:] for opt in parser._option_string_actions if opt.startswith("--")}


def collect(slime: Path, megatron: Path, sglang: Path) -> tuple[dict[str, set[str]], set[str]]:
    """Build the parsers; each third-party import found missing is stubbed and the build retried
    (a stub defines no flag: only the projects' own code does)."""
    for root in (sglang, megatron, slime):
        sys.path.insert(0, str(root))
    import typing

    if not hasattr(typing, "override"):  # Python 3.12's typing.override, which Megatron imports
        typing.override = lambda f: f  # type: ignore[attr-defined]
    with contextlib.suppress(ImportError):
        from torch.utils._triton import has_triton, has_triton_package

        has_triton_package()
        has_triton()
    stub = _StubMissing()
    sys.meta_path.append(stub)
    by_source = {"megatron": _retrying(stub, _megatron_flags)}
    by_source.update(_retrying(stub, _slime_flags))
    return by_source, stub.stubbed


def _retrying(stub: _StubMissing, build: Any) -> Any:
    for _ in range(100):
        try:
            return build()
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top in REQUIRED:
                raise SystemExit(f"{top} is needed to read the parsers: {REQUIRED[top]}") from exc
            if not top or top in OWN or top in sys.stdlib_module_names or top in stub.stubbed:
                raise
            stub.stubbed.add(top)
            for name in [m for m in sys.modules if m.split(".")[0] in OWN and not m.startswith("megatron")]:
                del sys.modules[name]  # re-import them against the new stand-in
    raise SystemExit("too many missing imports; install the projects' requirements")


def _megatron_flags() -> set[str]:
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, conflict_handler="resolve")
    return flags(add_megatron_arguments(parser) or parser)


def _slime_flags() -> dict[str, set[str]]:
    import slime.utils.arguments as slime_args
    from slime.backends.sglang_utils.arguments import add_sglang_arguments

    early = _capture_parser(slime_args._pre_parse_mode)
    parser = argparse.ArgumentParser(allow_abbrev=False, conflict_handler="resolve")
    own = flags(slime_args.get_slime_extra_args_provider()(parser) or parser) | early
    parser = argparse.ArgumentParser(allow_abbrev=False, conflict_handler="resolve")
    return {"slime": own, "sglang": flags(add_sglang_arguments(parser) or parser)}


def _capture_parser(build: Any) -> set[str]:
    """The flags of a function that builds an ArgumentParser and parses ``sys.argv`` with it."""
    seen: set[str] = set()
    original = argparse.ArgumentParser.parse_known_args

    def spy(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        seen.update(flags(self))
        return original(self, [], namespace)

    argparse.ArgumentParser.parse_known_args = spy  # type: ignore[method-assign]
    try:
        with contextlib.suppress(SystemExit):
            build()
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime", type=Path, required=True, help="a THUDM/slime checkout")
    ap.add_argument("--megatron", type=Path, required=True, help="an NVIDIA/Megatron-LM checkout")
    ap.add_argument("--sglang", type=Path, required=True,
                    help="a folder holding the sglang and sglang_router packages (unpacked wheels or python/)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    for name in ("slime", "megatron", "sglang"):
        if not getattr(args, name).is_dir():
            ap.error(f"--{name} {getattr(args, name)} is not a directory")
    with tempfile.TemporaryDirectory(prefix="polar-megatron-") as tree:
        megatron_commit = megatron_tree(args.slime, args.megatron, Path(tree))
        by_source, stubbed = collect(args.slime, Path(tree), args.sglang)
    names = sorted(set().union(*by_source.values()))
    missing = [a for a in ANCHORS if a not in names]
    if missing:
        raise SystemExit(f"the parsers yielded no {', '.join(missing)}: a parser was not read; nothing written")
    sglang_version = _version("sglang")
    if sglang_version == "unknown":
        sglang_version = next((p.name.split("-")[1] for p in args.sglang.glob("sglang-*.dist-info")), "unknown")
    router_version = next((p.name.split("-")[1].removesuffix(".dist") for p in args.sglang.glob("sglang_router-*.dist-info")),
                          "unknown")
    header = [
        "# slime flag names, generated by scripts/gen_slime_flags.py from the real argparse parsers of",
        f"# slime {_commit(args.slime)}, Megatron-LM {megatron_commit} + slime's docker/patch/latest, sglang {sglang_version} "
        f"and sglang-router {router_version}",
        "# (" + ", ".join(f"{k}: {len(v)}" for k, v in by_source.items()) + f"; {len(names)} distinct). "
        "Do not edit by hand; rerun the script.",
    ]
    args.out.write_text("\n".join(header + names) + "\n")
    print(f"wrote {len(names)} flags to {args.out} ({', '.join(f'{k} {len(v)}' for k, v in by_source.items())}); "
          f"stand-ins for uninstalled imports: {', '.join(sorted(stubbed)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
