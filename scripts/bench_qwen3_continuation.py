"""What the ``qwen3`` family's ``from_index`` render buys over ``hf:PATH`` on the same Qwen3 files.

Both render Qwen3's published template (``hf:`` through transformers' Jinja, ``qwen3`` in Python),
and both refuse where the template is not append-only. The difference is the cost of one token-in
continuation: ``hf:`` renders the whole history twice per call (so the gateway runs it off the event
loop), ``qwen3`` renders only the new messages. This builds a Qwen3 HF folder from our tokenizer
export plus the published template (``tests/fixtures/qwen3``), plays thinking-on tool loops of
growing length, checks that both families give the same continuation text, and prints CPU
milliseconds per continuation (``time.process_time``, median of the repeats) side by side.

    python scripts/bench_qwen3_continuation.py [--turns 5 25 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]


def tool_loop(turns: int) -> list[dict[str, Any]]:
    """A system prompt, one task, ``turns`` assistant tool calls (with reasoning) and their results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 20},
                                      {"role": "user", "content": "Fix the failing test in src/."}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"Step {i}: looking.", "reasoning_content": f"Plan {i}. " * 15,
                         "tool_calls": [{"id": f"c{i}", "type": "function",
                                         "function": {"name": "bash", "arguments": json.dumps({"command": f"cat f{i}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"def f{i}():\n    return {i}\n" * 10})
    return messages


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1000)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[5, 25, 100])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from polar_env.chat import chat_format
    from polar_env.chat.hf import HFChatFormat

    qwen3 = chat_format("qwen3")
    with tempfile.TemporaryDirectory(prefix="qwen3-hf-") as tmp:
        return compare(qwen3, HFChatFormat, Path(tmp), args.turns, args.repeats)


def compare(qwen3: Any, hf_format: Any, folder: Path, all_turns: list[int], repeats: int) -> int:
    start = time.process_time()
    qwen3.save_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (REPO / "tests" / "fixtures" / "qwen3" / "Qwen-Qwen3-0.6B.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    hf = hf_format(str(folder))
    print(f"tokenizer loaded: {hf.tokenizer.n_vocab} ids")  # once, outside the timings
    print(f"HF folder built and loaded in {time.process_time() - start:.1f} CPU-s; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'tool turns':>10} {'history chars':>13} {'hf: ms':>9} {'qwen3 ms':>9} {'ratio':>7}  same text")
    for turns in all_turns:
        messages = tool_loop(turns)
        cut = len(messages) - 1  # continue the last assistant turn with its tool result
        history = len(qwen3.render(messages, TOOLS))

        def run(fmt: Any, messages: list[dict[str, Any]] = messages, cut: int = cut) -> str:
            return str(fmt.continuation_text(messages, TOOLS, from_index=cut, enable_thinking=True))

        same = run(hf) == run(qwen3) and hf.render(messages, TOOLS) == qwen3.render(messages, TOOLS)
        base, ours = cpu_ms(lambda: run(hf), repeats), cpu_ms(lambda: run(qwen3), repeats)
        print(f"{turns:>10} {history:>13} {base:>9.2f} {ours:>9.3f} {base / max(ours, 1e-6):>6.0f}x  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
