"""Only ``polar_env/chat/`` knows a model family: everything else asks a ``ChatFormat``."""

from __future__ import annotations

import ast
from pathlib import Path

import polar_env
from polar_env.chat import TEMPLATES, chat_format, check_template

ROOT = Path(polar_env.__file__).parent
NEUTRAL = {"base", "bpe", "content", "detect", "hermes"}  # the seam's own modules under polar_env/chat/


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (``from x import y`` counts ``x`` and ``x.y``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def family_imports(path: Path) -> list[str]:
    """The imported modules that are a family's: ``polar_env.chat.<module or package>`` other than
    the seam's own (names imported from ``polar_env.chat`` itself are the seam's)."""
    chat = ROOT / "chat"
    out = []
    for name in imported(path):
        parts = name.split(".")
        if parts[:2] != ["polar_env", "chat"] or len(parts) < 3 or parts[2] in NEUTRAL:
            continue
        if (chat / f"{parts[2]}.py").is_file() or (chat / parts[2]).is_dir():
            out.append(name)
    return sorted(out)


def test_no_module_outside_chat_imports_a_family() -> None:
    leaks = {str(p.relative_to(ROOT)): family_imports(p) for p in ROOT.rglob("*.py")
             if ROOT / "chat" not in p.parents}
    assert {k: v for k, v in leaks.items() if v} == {}


def test_the_check_sees_a_family_import(tmp_path: Path) -> None:
    leak = tmp_path / "leak.py"
    leak.write_text("from polar_env.chat.qwen35.tokenizer import IM_END_ID\nfrom polar_env.chat import chat_format\n")
    assert family_imports(leak) == ["polar_env.chat.qwen35.tokenizer", "polar_env.chat.qwen35.tokenizer.IM_END_ID"]


def test_templates_are_checked_in_one_line(tmp_path: Path) -> None:
    assert check_template("qwen3.5") == "qwen3.5"
    for bad, says in (("qwen9", "unknown template 'qwen9'; known: " + ", ".join(TEMPLATES)),
                      (f"hf:{tmp_path}/nope", "does not exist")):
        try:
            check_template(bad)
        except ValueError as exc:
            assert says in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_one_format_object_per_template() -> None:
    assert chat_format("qwen3.5") is chat_format("qwen3.5")
    assert chat_format("append_only") is not chat_format("qwen3.5")
    assert chat_format("qwen3.5").eos_ids[0] == chat_format("qwen3.5").end_of_turn_id
