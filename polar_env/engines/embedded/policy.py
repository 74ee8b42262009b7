"""Scripted policy: deterministic assistant turns for multi-turn demos and tests.

The engine still runs the model; only the choice of tokens is forced to the scripted turn, so the
ids are a real tokenization and the logprobs are the model's. The step is picked from the
conversation: the number of assistant turns since the last real user query. A command step calls
the shell-like tool the harness declared (names differ per harness); without one it answers with
the last text step. ``{tool_output}`` in a text step becomes the last tool result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar_env.chat import ChatFormat
from polar_env.chat.content import content_text

SHELL_TOOLS = ("bash", "Bash", "exec_command", "run_shell_command", "shell", "shell_command", "terminal")
COMMAND_PARAMS = ("command", "cmd")
_TOOL_OUTPUT_LIMIT = 400  # characters of tool output quoted back; keeps demo turns short


@dataclass(frozen=True, slots=True)
class ScriptStep:
    command: str | None = None
    text: str = ""
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ScriptedPolicy:
    steps: tuple[ScriptStep, ...] = (
        ScriptStep(command="echo hi", reasoning="I should run the command."),
        ScriptStep(text="The command printed: {tool_output}", reasoning="The tool answered."),
    )
    shell_tools: tuple[str, ...] = SHELL_TOOLS
    command_params: tuple[str, ...] = COMMAND_PARAMS

    @classmethod
    def from_dict(cls, data: Any) -> ScriptedPolicy:
        """The policy a JSON file holds; ValueError naming the part that is wrong (which step, which
        key), never Python's own words about ``**`` or dataclasses."""
        if not isinstance(data, Mapping):
            raise ValueError(f"the file holds {_kind(data)}, not an object like {EXAMPLE}")
        unknown = sorted(set(data) - set(POLICY_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(POLICY_KEYS)})")
        raw = data.get("steps", [])
        if not isinstance(raw, list):
            raise ValueError(f"'steps' is {_kind(raw)}, not a list of steps like {EXAMPLE}")
        steps = tuple(_step(i, step) for i, step in enumerate(raw, 1))
        return cls(
            steps=steps or cls().steps,
            shell_tools=_names(data.get("shell_tools", SHELL_TOOLS), "shell_tools"),
            command_params=_names(data.get("command_params", COMMAND_PARAMS), "command_params"),
        )

    def next_turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The scripted assistant message (OpenAI shape, arguments as a mapping) for this point."""
        step = self.steps[min(_turns_since_query(messages), len(self.steps) - 1)]
        if step.command is not None:
            call = self._shell_call(step.command, tools)
            if call is not None:
                return {"role": "assistant", "content": step.text, "reasoning_content": step.reasoning, "tool_calls": [call]}
            step = next((s for s in reversed(self.steps) if s.command is None), ScriptStep(text=""))
        text = step.text.replace("{tool_output}", _last_tool_output(messages))
        return {"role": "assistant", "content": text, "reasoning_content": step.reasoning}

    def response_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], *,
                      thinking: bool, chat: ChatFormat) -> str:
        """The scripted turn as the model writes it after the generation prompt (before its
        end-of-turn token), in ``chat``'s format."""
        return chat.assistant_text(self.next_turn(messages, tools), thinking=thinking)

    def _shell_call(self, command: str, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
        declared = {fn.get("name"): fn for fn in (t.get("function", t) for t in tools)
                    if isinstance(fn, Mapping) and isinstance(fn.get("name"), str)}
        name = next((n for n in self.shell_tools if n in declared), None)
        if name is None:
            return None
        params = declared[name].get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        props = props if isinstance(props, Mapping) else {}
        param = next((p for p in self.command_params if p in props), self.command_params[0])
        schema = props.get(param)
        # Codex's `shell` tool takes an argv array; everything else a command string.
        is_array = isinstance(schema, Mapping) and schema.get("type") == "array"
        value: Any = ["bash", "-lc", command] if is_array else command
        return {"type": "function", "function": {"name": name, "arguments": {param: value}}}


POLICY_KEYS = ("steps", "shell_tools", "command_params")
STEP_KEYS = ("command", "text", "reasoning")
EXAMPLE = '{"steps": [{"command": "ls"}, {"text": "done"}]}'


def _kind(value: object) -> str:
    """A JSON value as a user names it: ``a number (1)``, ``a list``, ``a string ('x')``."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    shown = f" ({value!r:.40})" if isinstance(value, bool | int | float | str) else ""
    return ("null" if value is None else names.get(type(value), type(value).__name__)) + shown


def _step(n: int, step: object) -> ScriptStep:
    if not isinstance(step, Mapping):
        raise ValueError(f"step {n} is {_kind(step)}, not an object like {{\"command\": \"ls\"}} or {{\"text\": \"done\"}}")
    unknown = sorted(set(step) - set(STEP_KEYS))
    if unknown:
        raise ValueError(f"step {n} has unknown key {unknown[0]!r} (known: {', '.join(STEP_KEYS)})")
    for key in STEP_KEYS:
        value = step.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"step {n}: {key!r} is {_kind(value)}, not a string")
    return ScriptStep(command=step.get("command"), text=step.get("text") or "", reasoning=step.get("reasoning") or "")


def _names(value: object, key: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} is {_kind(value)}, not a non-empty list of names")
    return tuple(value)


def _turns_since_query(messages: Sequence[Mapping[str, Any]]) -> int:
    turns = 0
    for msg in reversed(messages):
        role = msg.get("role")
        if role == "assistant":
            turns += 1
        elif role == "user":
            text = content_text(msg.get("content")).strip()
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                break
    return turns


def _last_tool_output(messages: Sequence[Mapping[str, Any]]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "tool":
            return content_text(msg.get("content")).strip()[:_TOOL_OUTPUT_LIMIT]
    return ""


@dataclass(frozen=True, slots=True)
class FinishingPolicy(ScriptedPolicy):
    """``ScriptedPolicy`` whose text answers also run ``finish_command`` through the shell tool."""

    finish_command: str | None = None

    def next_turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turn = ScriptedPolicy.next_turn(self, messages, tools)
        if turn.get("tool_calls") or self.finish_command is None:
            return turn
        finisher = ScriptedPolicy(steps=(ScriptStep(command=self.finish_command),), shell_tools=self.shell_tools,
                                  command_params=self.command_params)
        finish = finisher.next_turn(messages, tools)
        if not finish.get("tool_calls"):  # the harness declared no shell tool: nothing to finish with
            return turn
        return {**turn, "tool_calls": finish["tool_calls"]}
