"""``images build`` and ``images unpack``: make the local images SWE rows name, where no registry is
reachable (a recipe build, or an image saved elsewhere and carried over)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from polar_env.cli.checks import add_command, existing_dir
from polar_env.errors import ConfigError, PolarError


def _store(args: argparse.Namespace) -> Path:
    from polar_env.runtimes.bundle import images_root

    store = Path(args.store) if args.store else images_root()
    if store.exists() and not store.is_dir():
        raise ConfigError(f"--store {store} is a file, not a folder; pass the image store directory")
    return store


def cmd_build(args: argparse.Namespace) -> int:
    """Build the selected rows' images; one line per image, a JSON summary with --json."""
    from polar_env.tasks.image_build import Builder, BuildOptions, BuildResult, default_base
    from polar_env.tasks.sources import load_swe_tasks, unknown_ids_message
    from polar_env.tasks.swe import SweTask

    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: give 1 or more parallel builds")
    tasks = load_swe_tasks(args.tasks)
    if args.ids:
        by_id = {t.instance_id: t for t in tasks}
        unknown = [i for i in args.ids if i not in by_id]
        if unknown:
            raise ConfigError(unknown_ids_message(unknown, by_id, args.tasks))
        tasks = [by_id[i] for i in dict.fromkeys(args.ids)]
    base = Path(args.base) if args.base else default_base(os.environ)
    if not base.is_dir():
        raise ConfigError(f"--base {base}: no such rootfs folder; make it with scripts/build_rootfs.sh (debootstrap, as root) "
                          "or pass --base ROOTFS_DIR")
    repos = existing_dir(args.repos, "--repos", "pass the folder of <instance_id>.tar.gz files") if args.repos else None
    opts = BuildOptions.from_env(os.environ, store=_store(args), base=base, repos=repos, kind=args.kind,
                                 base_image=args.base_image)
    builder = Builder(opts)
    plans, without = [], []
    for task in tasks:
        try:
            builder.plan(task)
            plans.append(task)
        except ConfigError as exc:
            if args.ids or "no environment_setup" not in str(exc):
                raise  # a row the user named, or a problem other than a missing recipe: one line, nothing built
            without.append(task.instance_id)
    if not plans:
        raise ConfigError(f"{args.tasks}: no row has an environment_setup to build from; run the rows' published images "
                          "or polar-env images unpack saved copies")
    out = sys.stderr if args.json else sys.stdout
    if without:
        print(f"skipped {len(without)} rows without environment_setup (use their published images or unpack them): "
              f"{', '.join(without[:8])}{' ...' if len(without) > 8 else ''}", file=out)
    results: list[BuildResult] = []
    failed: list[dict[str, str]] = []

    def one(task: SweTask) -> None:
        try:
            result = builder.build(task)
        except PolarError as exc:
            failed.append({"instance_id": task.instance_id, "error": str(exc)})
            print(f"{task.instance_id}: failed: {exc}", file=out, flush=True)
            return
        results.append(result)
        print(result.line(), file=out, flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, plans))
    if args.json:
        print(json.dumps({"images": [r.to_json() for r in results], "failed": failed, "without_recipe": without}, indent=2))
    return 1 if failed else 0


def cmd_unpack(args: argparse.Namespace) -> int:
    from polar_env.tasks.image_unpack import unpack

    result = unpack(Path(args.src), args.name, _store(args))
    print(result.line())
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = add_command(sub, "images", "make the local images SWE rows name (recipe builds, unpacked saved images)")
    isub = group.add_subparsers(dest="images_command", required=True, metavar="SUBCOMMAND", help="build or unpack")

    p = add_command(isub, "build", "build each row's image from its environment_setup (uv venv + install lines)")
    p.add_argument("tasks", metavar="TASKS", help="task rows: a .jsonl / .json / .parquet file")
    p.add_argument("--ids", nargs="+", metavar="ID", help="only these instance ids (default: every row with an environment_setup)")
    p.add_argument("--kind", choices=("rootfs", "docker", "sif"), default="rootfs",
                   help="rootfs: an OCI bundle in the store; docker: also a Docker image of the row's image name; "
                   "sif: also <store>/<name>.sif (Apptainer)")
    p.add_argument("--base", metavar="ROOTFS_DIR", help="base root filesystem (default: scripts/build_rootfs.sh's)")
    p.add_argument("--base-image", metavar="TAG", default="polar-test/py:bookworm",
                   help="docker kind: the Docker import of --base to build FROM")
    p.add_argument("--repos", metavar="DIR", help="<instance_id>.tar.gz (git archive at base_commit) or <instance_id>/ "
                   "checkouts (default: git clone from github.com)")
    p.add_argument("--store", metavar="DIR", help="the image store (default: $POLAR_IMAGES or ~/.cache/polar_env/images)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="images built at once")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout (the per-image lines go to stderr)")
    p.set_defaults(func=cmd_build)

    p = add_command(isub, "unpack", "write a saved image (docker save tar, OCI layout, Apptainer sandbox) into the store")
    p.add_argument("src", metavar="SRC", help="a docker save archive, an OCI image layout folder, or an Apptainer sandbox folder")
    p.add_argument("--name", required=True, metavar="IMAGE", help="the image name rows use (e.g. docker.io/x/y:latest)")
    p.add_argument("--store", metavar="DIR", help="the image store (default: $POLAR_IMAGES or ~/.cache/polar_env/images)")
    p.set_defaults(func=cmd_unpack)
