r"""One prefix per group: ids the trainer forwards per sampled token, one row per trace (before)
vs one prefix per group (after), on the CPU GRPO recipes and on replayed real-CLI requests; and
the recipe's reward curve and losses against a ``--baseline-rev`` tree (same seed), side by side.

Recipes: each run in a subprocess at ``--steps`` steps (held-out tasks dropped), this tree and the
baseline tree alternating for ``--rounds`` rounds; train s/step is the median over the rounds.
Real CLIs: each CLI's recorded main request (tests/fixtures/providers/captured/<cli>/) posted as
``--siblings`` sessions of one group through the real gateway and the embedded engine (seeded
tiny model, ``--max-tokens`` sampled), prefix-merged, then laid out per group.

    python scripts/bench_group_prefix.py [--recipes recipes/cpu_grpo_toy.yaml recipes/cpu_grpo_smollm2.yaml]
        [--steps 3] [--rounds 1] [--rollouts N] [--baseline-rev HEAD [--only PATH ...] [--on-rev] | --no-baseline] [--no-recipes] [--no-cli]
        [--json out.json]
    # the change alone, against a tree others are editing too:
    python scripts/bench_group_prefix.py --no-cli --only polar_env/train/trainer.py polar_env/train/loop.py \
        polar_env/train/command.py
    # the same, both trees on the committed rev (reward curves comparable step by step):
    python scripts/bench_group_prefix.py --no-cli --recipes recipes/cpu_grpo_toy.yaml --on-rev --only \
        polar_env/train/trainer.py polar_env/train/loop.py polar_env/train/command.py \
        polar_env/train/shared_forward.py polar_env/trajectory/group_prefix.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import TypedDict

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = ROOT / "tests" / "fixtures" / "providers" / "captured"
# the recorded request of each CLI's main agent (the others are title / probe requests)
CLI_REQUESTS = {"claude-anthropic": ("02.json", "/v1/messages"), "codex-openai_responses": ("02.json", "/v1/responses"),
                "gemini-gemini": ("02.json", None), "opencode-openai_chat": ("02.json", "/v1/chat/completions"),
                "pi-openai_chat": ("02.json", "/v1/chat/completions"), "qwen-openai_chat": ("02.json", "/v1/chat/completions")}

RUN = r"""
import asyncio, json, sys
from pathlib import Path
from polar_env.train.loop import run_recipe
from polar_env.train.recipe import Recipe
overrides = {"steps": int(sys.argv[2]), "out_dir": sys.argv[3] + "/{name}", "held_out": []}
if int(sys.argv[4]):
    overrides["rollouts_per_task"] = int(sys.argv[4])
recipe = Recipe.load(Path(sys.argv[1]), overrides)
result = asyncio.run(run_recipe(recipe))
steps = result.steps
print("RESULT " + json.dumps({
    "rewards": [s.reward_mean for s in steps], "losses": [s.loss for s in steps],
    "train_s": [s.train_s for s in steps], "step0": max(s.step0_max_abs_delta for s in steps),
    "sampled": sum(s.sampled_tokens for s in steps),
    "full": sum(getattr(s, "full_tokens", 0) for s in steps),
    "shared": sum(getattr(s, "forwarded_tokens", 0) for s in steps)}))
"""


def baseline_tree(rev: str, only: list[str]) -> Path:
    """``git archive`` of ``rev`` into a temp folder (read-only on the repository); with ``only``,
    this working tree's package with just those paths taken from ``rev`` (the change under test
    undone, everything else as it is here)."""
    out = Path(tempfile.mkdtemp(prefix=f"polar-bench-group-prefix-{rev}-"))
    out.chmod(0o755)  # the sandbox's unprivileged uid must reach the package (the loop harness's relay)
    if only:
        shutil.copytree(ROOT / "polar_env", out / "polar_env", ignore=shutil.ignore_patterns("__pycache__"))
        for path in only:
            blob = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
            (out / path).write_bytes(blob)
        return out
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out


class RunOut(TypedDict):
    rewards: list[float]
    losses: list[float]
    train_s: list[float]
    step0: float
    sampled: int
    full: int  # 0 from a tree without one prefix per group
    shared: int


def run_recipe_in(tree: Path, recipe: Path, steps: int, rollouts: int) -> RunOut:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="bench-gp-") as out:
        Path(out).chmod(0o755)
        proc = subprocess.run([sys.executable, "-c", RUN, str(recipe.resolve()), str(steps), out, str(rollouts)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{recipe} in {tree} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result: RunOut = json.loads(line[len("RESULT "):])
    if not result["sampled"]:
        raise SystemExit(f"{recipe} in {tree}: no token trained in {steps} steps (every session failed?)")
    return result


def recipes_table(args: argparse.Namespace) -> dict[str, object]:
    if args.no_baseline:
        trees = {"after": ROOT}
    elif args.on_rev:  # both on the rev; after = the rev plus this tree's --only paths
        trees = {"before": baseline_tree(args.baseline_rev, []), "after": baseline_tree(args.baseline_rev, [])}
        for path in args.only:
            (trees["after"] / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, trees["after"] / path)
    else:
        trees = {"before": baseline_tree(args.baseline_rev, args.only), "after": ROOT}
    try:
        return recipes_rounds(args, trees)
    finally:
        for tree in trees.values():
            if tree != ROOT:
                shutil.rmtree(tree, ignore_errors=True)


def recipes_rounds(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, object]:
    out: dict[str, object] = {}
    for recipe in map(Path, args.recipes):
        runs: dict[str, list[RunOut]] = {k: [] for k in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():  # alternating
                runs[name].append(run_recipe_in(tree, recipe, args.steps, args.rollouts))
        after = runs["after"][0]
        sampled = after["sampled"]
        print(f"\n{recipe.name} ({args.steps} steps, {args.rounds} round(s); load {load()})")
        print(f"  ids forwarded / sampled token: one row per trace {after['full'] / sampled:.2f}"
              f"  one prefix per group {after['shared'] / sampled:.2f}"
              f"  ({after['full']} -> {after['shared']} ids for {sampled} sampled)")
        for name, rs in runs.items():
            train_s = statistics.median(statistics.mean(r["train_s"]) for r in rs)
            print(f"  {name:>6}: rewards {[round(x, 4) for x in rs[0]['rewards']]}  "
                  f"losses {[f'{x:.6g}' for x in rs[0]['losses']]}  train {train_s:.2f} s/step  step-0 max|Δ| {rs[0]['step0']:.1e}")
        if "before" in runs:
            b, a = runs["before"][0], runs["after"][0]
            dl = max(abs(x - y) for x, y in zip(b["losses"], a["losses"], strict=True))
            print(f"  same rewards: {b['rewards'] == a['rewards']}; max |Δ loss| {dl:.2e}")
        out[recipe.name] = runs
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def cli_groups(siblings: int, max_tokens: int) -> dict[str, object]:
    """Each CLI's recorded main request as ``siblings`` sessions of one group through the gateway."""
    sys.path.insert(0, str(ROOT))
    from polar_env.chat import chat_format
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.records import Trajectory
    from polar_env.trajectory.group_prefix import group_layouts
    from polar_env.trajectory.prefix_merge import build_prefix_merged
    from tests.proxy.conftest import Gateway, start_gateway

    out: dict[str, object] = {}
    print(f"\nreal-CLI requests, {siblings} siblings each, {max_tokens} tokens sampled per call (load {load()})")
    for cli, (name, path) in CLI_REQUESTS.items():
        body = json.loads((CAPTURED / cli / name).read_text())
        if path is None:  # gemini: the recorded path names the model
            row = next(json.loads(ln) for ln in (CAPTURED / cli / "requests.jsonl").read_text().splitlines()
                       if json.loads(ln).get("file") == name)
            path = row["path"].replace(":streamGenerateContent", ":generateContent")
        body.pop("stream_options", None)
        if "stream" in body:
            body["stream"] = False
        for key in ("max_tokens", "max_output_tokens"):
            if key in body:
                body[key] = max_tokens
        if isinstance(body.get("generationConfig"), dict):
            body["generationConfig"]["maxOutputTokens"] = max_tokens
        engine = EmbeddedEngine(chat=chat_format("qwen3.5"), max_tokens=max_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            client, store = await start_gateway(engine, Path(tmp), template="qwen3.5")
            try:
                gw = Gateway(client, store)
                trajectories = []
                for i in range(siblings):
                    s = await gw.session(session_id=f"{cli}-{i}")
                    auth = {"Authorization": f"Bearer {s['key']}", "x-api-key": s["key"], "x-goog-api-key": s["key"]}
                    resp = await gw.post(path, body, auth)
                    if resp.status != 200:
                        raise SystemExit(f"{cli}: gateway answered {resp.status}: {(await resp.text())[:300]}")
                    traj = build_prefix_merged(store.read(f"{cli}-{i}"))
                    trajectories.append(Trajectory(session_id=traj.session_id, traces=traj.traces, group_id=cli))
            finally:
                await client.close()
        (layout,) = group_layouts(trajectories, trainable_only=True)
        sampled = sum(sum(m.loss_mask) for m in layout.members)
        full, shared = layout.full_tokens(), layout.forwarded_tokens()
        print(f"  {cli:<24} prompt {len(layout.prefix_ids) + 1:>6} ids  sampled {sampled:>4}  ids forwarded / sampled: "
              f"one row per trace {full / sampled:8.1f}  one prefix per group {shared / sampled:7.1f}  ({full / shared:.1f}x fewer)")
        out[cli] = {"sampled": sampled, "full": full, "shared": shared, "prefix": len(layout.prefix_ids)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["recipes/cpu_grpo_toy.yaml", "recipes/cpu_grpo_smollm2.yaml"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=0, help="rollouts per task (the GRPO group size); 0: the recipe's")
    ap.add_argument("--baseline-rev", default="HEAD")
    ap.add_argument("--only", nargs="*", default=[], metavar="PATH",
                    help="baseline = this tree with only these paths at --baseline-rev")
    ap.add_argument("--on-rev", action="store_true",
                    help="before = --baseline-rev, after = --baseline-rev plus this tree's --only paths (isolates the "
                         "change from others' uncommitted edits, e.g. an engine that no longer samples reproducibly)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-recipes", action="store_true")
    ap.add_argument("--no-cli", action="store_true")
    ap.add_argument("--siblings", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, object] = {"load_start": load()}
    if not args.no_cli:
        results["cli"] = asyncio.run(cli_groups(args.siblings, args.max_tokens))
    if not args.no_recipes:
        results["recipes"] = recipes_table(args)
    results["load_end"] = load()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
