"""The journal's seams as structure (docs/architecture.md, "Seams"): readers take a
``JournalSource``, writers a ``JournalSink``, code that opens a store by folder a ``JournalOpener``;
only the composition roots below name the concrete file store, and nothing downcasts to it. So a
new store is its module plus the root that builds it (the memory store is that second store: one
file, named by no module outside ``polar_env/journal/``)."""

from __future__ import annotations

import ast
from functools import partial
from pathlib import Path

from polar_env.journal.memory import MemoryJournalStore
from polar_env.journal.store import JournalStore
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from polar_env.staging.postrun_pool import PostrunPool, read_and_build
from tests.conftest import REPO_ROOT

STORES = ("JournalStore", "MemoryJournalStore")  # the concrete stores polar_env/journal/ defines

ROOTS = {  # the modules that may name the concrete store, and why each is a root
    "polar_env/cli/serving.py": "`polar-env gateway`: a gateway over the --store folder",
    "polar_env/cli/store.py": "`polar-env build`/`verify`: the --store folders",
    "polar_env/cli/integrations.py": "`polar-env sft`: the run folder it exports",
    "polar_env/staging/node.py": "node start: where a node's journal is built",
    "polar_env/staging/server.py": "the rollout server: salvages a dead node's shard",
    "polar_env/staging/job.py": "a job: its run folder (resume, interruption marks)",
    "polar_env/dashboard/server.py": "the dashboard server: the run folders it shows",
    "polar_env/env.py": "the Python API: `polar_env.build_trajectories(folder)`",
    "polar_env/demo.py": "the demo program: its own gateway",
    "polar_env/train/rollout.py": "the CPU GRPO program: its own gateway",
    "polar_env/testing/harness_check.py": "the harness check program: its own gateway",
    "polar_env/integrations/nemo_gym/gym_root/responses_api_agents/polar_agent/app.py": "NeMo Gym's server",
}


def store_mentions(source: str, names: tuple[str, ...] = STORES) -> list[tuple[int, str]]:
    """(line, how) for each place a module names a concrete store: imports it (under any alias),
    calls it, passes it, or reaches it as ``module.JournalStore``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"imports {a.name}") for a in node.names if a.name in names]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append((node.lineno, f"uses {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, f"uses .{node.attr}"))
    return sorted(found)


def offenders(repo: Path, roots: dict[str, str]) -> list[str]:
    """Modules outside polar_env/journal/ and ``roots`` that name a concrete store."""
    out = []
    for path in sorted((repo / "polar_env").rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith("polar_env/journal/") or rel in roots:
            continue
        out += [f"{rel}:{line} {how}" for line, how in store_mentions(path.read_text())]
    return out


def test_only_composition_roots_name_the_concrete_store() -> None:
    bad = offenders(REPO_ROOT, ROOTS)
    assert not bad, (f"{bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}: take a JournalSource / "
                     "JournalSink, or a JournalOpener from the root (polar_env/journal/protocols.py)")


def test_every_listed_root_still_names_it() -> None:
    """The list stays tight: a module that stopped naming the store leaves it."""
    stale = [rel for rel in ROOTS if not store_mentions((REPO_ROOT / rel).read_text(), ("JournalStore",))]
    assert not stale, f"{stale[0]} no longer names JournalStore: drop it from ROOTS"


def test_the_scan_sees_construction_passing_aliases_and_downcasts(tmp_path: Path) -> None:
    pkg = tmp_path / "polar_env"
    (pkg / "journal").mkdir(parents=True)
    (pkg / "journal" / "store.py").write_text("class JournalStore: ...\n")  # the journal package may
    (pkg / "root.py").write_text("from polar_env.journal.store import JournalStore\nJournalStore(1)\n")
    (pkg / "calls.py").write_text("def f(p):\n    from polar_env.journal.store import JournalStore\n"
                                  "    return JournalStore(p)\n")
    (pkg / "passes.py").write_text("import polar_env.journal.store as js\nopen_it = js.JournalStore\n")
    (pkg / "alias.py").write_text("from polar_env.journal.store import JournalStore as S\n")
    (pkg / "downcast.py").write_text("def f(s, JournalStore=None):\n    assert isinstance(s, JournalStore)\n")
    (pkg / "clean.py").write_text("from polar_env.journal.protocols import JournalSource\n")
    found = offenders(tmp_path, {"polar_env/root.py": "a root"})
    assert found == ["polar_env/alias.py:1 imports JournalStore",
                     "polar_env/calls.py:2 imports JournalStore", "polar_env/calls.py:3 uses JournalStore",
                     "polar_env/downcast.py:2 uses JournalStore", "polar_env/passes.py:2 uses .JournalStore"]


def test_the_protocols_import_no_store() -> None:
    tree = ast.parse((REPO_ROOT / "polar_env/journal/protocols.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not imported & {"polar_env.journal.store", "polar_env.journal.memory"}, imported
    assert not store_mentions((REPO_ROOT / "polar_env/journal/protocols.py").read_text())


def test_no_root_downcasts_to_the_concrete_store() -> None:
    """A root keeps the store it built; it never asks a sink whether it is a JournalStore."""
    for rel in ROOTS:
        for node in ast.walk(ast.parse((REPO_ROOT / rel).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                assert not store_mentions(ast.unparse(node)), f"{rel}:{node.lineno} downcasts to a concrete store"


def _calls(store: JournalStore | MemoryJournalStore, n: int) -> None:
    for seq in range(n):
        store.append(CompletionRecord(
            message=AssistantMessage(content=f"answer {seq}"), prompt_ids=[1, 2, 3 + seq], response_ids=[7, 8],
            response_logprobs=[-0.5, -0.25], finish_reason="stop", session_id="s", seq=seq,
            provider_api=ProviderAPI.OPENAI_CHAT, provider_request={"n": seq},
            chat_request=ChatRequest(messages=[{"role": "user", "content": "q"}]), timings=Timings(received_at=0.0)))


async def test_postrun_builds_a_memory_journal_in_the_node(tmp_path: Path) -> None:
    """A store with no files cannot be reopened in a worker: POSTRUN reads it in the node, and
    builds what the file store's worker path builds."""
    memory = MemoryJournalStore()
    _calls(memory, 3)
    _calls(files := JournalStore(tmp_path), 3)
    pool = PostrunPool(1)
    built = await pool.build(lambda: memory, "s", "prefix_merge")
    assert pool._pool is None  # no worker process
    assert built.error is None and built.records == 3
    assert built == read_and_build(partial(JournalStore, tmp_path), "s", "prefix_merge")
    files.close()
