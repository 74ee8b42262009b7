"""``python -m polar_env.harnesses [list | install NAME... | show NAME]``.

``list`` prints the presets and whether each is installed; ``install`` installs into the shared cache
(``$POLAR_HARNESS_CACHE``, ``$POLAR_NPM_CACHE`` or ``~/.cache/polar_env/harnesses``; a no-op for
those already installed) and prints ``<name> <binary path>`` per harness; ``show`` prints one
preset's rendered command, env and files for placeholder values.
"""

from __future__ import annotations

import argparse
import sys

from polar_env.errors import ConfigError
from polar_env.harnesses import HARNESSES, default_cache_dir, ensure_installed, get_harness, is_installed, render


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polar_env.harnesses", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the presets and their install state")
    inst = sub.add_parser("install", help="install harnesses into the shared cache")
    inst.add_argument("names", nargs="+", help="harness names (or 'all')")
    show = sub.add_parser("show", help="a preset rendered for placeholder values")
    show.add_argument("name")
    show.add_argument("--api", help="wire format (default: the harness's default)")
    args = p.parse_args(argv)
    cache = default_cache_dir()
    try:
        if args.cmd == "list":
            for h in HARNESSES.values():
                state = "installed" if is_installed(h, cache) else "not installed"
                apis = ",".join(a.value for a in h.apis)
                print(f"{h.name:16} {h.install.requirement:45} {apis:55} {state}")
        elif args.cmd == "install":
            names = list(HARNESSES) if args.names == ["all"] else args.names
            for name in names:
                harness = get_harness(name)
                print(f"{harness.name} {ensure_installed(harness, cache)}", flush=True)
        else:
            harness = get_harness(args.name)
            client = harness.client(args.api)
            cmd, env, files = render(client, "http://127.0.0.1:8100", "<key>", "<model>", "/root", "<prompt>")
            print("argv:", cmd)
            for k, v in env.items():
                print(f"env: {k}={v}")
            for path, text in files.items():
                print(f"--- ~/{path}\n{text}", end="" if text.endswith("\n") else "\n")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
