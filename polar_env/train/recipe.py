"""The training recipe: one YAML file, validated once at the CLI edge and passed down.

Every field has a default sized for the toy run on 2 shared CPU cores; a recipe file overrides a
few. ``control: true`` turns a run into the shuffled-reward control (same data path, rewards
permuted within each group, so nothing the policy does changes its reward). ``held_out`` tasks are
never trained on: the loop rolls them out before the first step and after the last, so a gain that
is memorized per training task shows up as none there.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polar_env.evaluators import EvaluatorSpec
from polar_env.records import LogprobsMode
from polar_env.train.rollout import ToyTask
from polar_env.train.trainer import TrainerConfig
from polar_env.yaml_config import read_mapping, validated


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskRow(_Section):
    task_id: str
    instruction: str
    follow_ups: list[str] = Field(default_factory=list)
    # relative path -> text, written into each session's workspace (source: polar_env): what the
    # agent's tools can read; the answer's evaluator knows it, the instruction need not
    files: dict[str, str] = Field(default_factory=dict)
    evaluator: EvaluatorSpec | None = None  # this task's own check (e.g. its file's word); else the recipe's

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            path = PurePosixPath(name)
            if not name or path.is_absolute() or ".." in path.parts:
                raise ValueError(f"file {name!r}: give a path relative to the workspace, without '..'")
        return value


class AgentSection(_Section):
    """The ``loop`` harness of ``source: polar_env``: by default one answer and no tools (a random
    model never writes a valid call); ``tools: true`` offers its ``bash`` tool, multi-turn."""

    tools: bool = False
    max_turns: int = Field(default=1, ge=1)  # model calls per session; a tool result needs one more to answer
    system: str | None = None  # the loop's own system prompt when None


class EngineSection(_Section):
    model_seed: int | None = None  # seed of the random initial weights; None = the run's seed
    logprobs_mode: LogprobsMode = "processed"
    # the model family; smollm2 / hf:PATH start from that model's real weights instead of random ones
    template: str = "qwen3.5"

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        from polar_env.chat import check_template

        if value == "auto":
            raise ValueError("template 'auto' does not apply to a recipe, which starts from its template's own "
                             "weights: name one (smollm2, hf:PATH, qwen3.5)")
        return check_template(value)


class SamplingSection(_Section):
    temperature: float = 1.0
    max_tokens: int = 6  # per call; a random model never stops on its own


class TrainerSection(_Section):
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    tis_clip: float = 2.0
    kl_coef: float = 0.0
    std_normalize: bool = True

    def config(self) -> TrainerConfig:
        return TrainerConfig(lr=self.lr, max_grad_norm=self.max_grad_norm, tis_clip=self.tis_clip,
                             kl_coef=self.kl_coef, std_normalize=self.std_normalize)


class Recipe(_Section):
    name: str = "run"
    seed: int = 0
    steps: int = 20
    rollouts_per_task: int = 8  # the GRPO group size
    tasks: list[TaskRow]
    held_out: list[TaskRow] = Field(default_factory=list)  # never trained on; rolled out before and after
    held_out_rollouts: int = Field(default=8, ge=1)  # per held-out task, each time
    evaluator: EvaluatorSpec | None = None  # every task's, unless a task gives its own
    builder: str = "prefix_merge_strict"  # every merged trace is exactly a context the model saw
    # polar_env: the staged pipeline (sandboxed sessions, the loop harness: one answer, or tool turns
    # with agent.tools);
    # local: gateway + a multi-turn chat loop in this process (follow_ups make sessions multi-call)
    source: Literal["polar_env", "local"] = "polar_env"
    control: bool = False
    engine: EngineSection = Field(default_factory=EngineSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    out_dir: str = "runs/{name}-seed{seed}"  # relative to the working directory

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.source == "polar_env" and any(t.follow_ups for t in self.tasks):
            raise ValueError("follow_ups need source: local (the loop harness ends a session at its first answer)")
        rows = [*self.tasks, *self.held_out]
        if self.source == "local" and (any(t.files for t in rows) or self.agent != AgentSection()):
            raise ValueError("files and agent settings need source: polar_env (the local chat loop has no tools "
                             "and no workspace)")
        if self.agent.tools and self.agent.max_turns < 2:
            raise ValueError("agent.tools needs agent.max_turns >= 2: a tool result needs a turn to answer in")
        if self.evaluator is None and (bare := [t.task_id for t in rows if t.evaluator is None]):
            raise ValueError(f"task {bare[0]!r} has no evaluator: give the recipe one, or every task its own")
        ids = [t.task_id for t in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"task ids must be unique across tasks and held_out; repeated: "
                             f"{sorted({i for i in ids if ids.count(i) > 1})}")
        return self

    def toy_tasks(self) -> list[ToyTask]:
        return [self._task(row) for row in self.tasks]

    def held_out_tasks(self) -> list[ToyTask]:
        return [self._task(row) for row in self.held_out]

    def _task(self, row: TaskRow) -> ToyTask:
        evaluator = row.evaluator or self.evaluator
        assert evaluator is not None  # checked by _consistent
        return ToyTask(**row.model_dump(exclude={"evaluator"}), evaluator=evaluator)

    def run_dir(self) -> Path:
        return Path(self.out_dir.format(name=self.name, seed=self.seed))

    @classmethod
    def load(cls, path: Path, overrides: dict[str, Any] | None = None) -> Recipe:
        """Read and validate a recipe; any problem is one ConfigError line naming the file."""
        data = read_mapping(path, "recipe")
        data.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return validated(cls, data, path, "recipe")
