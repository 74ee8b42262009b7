"""``polar-env`` command line: the only place that reads argv and the environment.

One module per command group; each has ``add_commands(sub)`` and ``cmd_*`` functions. The options
that set configuration are one table, ``options.FLAGS`` (flag -> config field), and the engine kind
one rule, ``options.engine_kind``. A user's mistake raises ``ConfigError`` (or another
``PolarError``), and ``main`` turns it into one line on stderr and exit code 2, never a traceback. A
missing optional extra is reported the same way, with the command that installs it.
"""

from __future__ import annotations

import argparse
import sys

from polar_env import __version__
from polar_env.cli import cluster, images, integrations, rollout, serving, store
from polar_env.cli.checks import HelpFormatter, missing_extra_message
from polar_env.errors import PolarError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-env", description="Unmodified agent harnesses as token-faithful RL environments.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"polar-env {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (serving, store, rollout, integrations, images, cluster):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user's mistake is one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):
        from polar_env.access_log import configure

        configure(args.log_level)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except PolarError as exc:
        print(f"polar-env {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc, args.command)
        if message is None:
            raise
        print(f"polar-env {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        print(f"polar-env {args.command}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
