"""Records that cross process and disk boundaries: chat requests, engine generations, captured
completions, traces and trajectories.

Invariants are checked at construction (logprobs align 1:1 with response ids; loss masks are 0/1 and
as long as the response), so no builder or engine client can emit a malformed record. Serialization
is orjson over ``model_dump`` and is lossless: token ids are ints, logprobs are float64 and round-trip
through orjson's shortest representation.
"""

from __future__ import annotations

import enum
import re
from typing import Any, ClassVar, Literal, Self

import orjson
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, model_validator
from pydantic_core import CoreSchema, core_schema

_PROVIDER_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class ProviderAPI(str):
    """The name of a wire format the gateway speaks to harnesses (``anthropic``, ``openai_chat``).

    The set is open: each module in ``proxy/providers/`` is registered under its name in
    ``PROVIDERS``, the one table. A record only checks the name's shape: records sit below the
    gateway, and a journal must load whatever provider wrote it (files from the enum this replaced
    hold the same strings). A name a user chooses (``api:`` of a config, a task or a harness file,
    ``--api``) is checked against ``PROVIDERS`` where it is chosen. The constants name the built-in
    providers for the presets that speak them; a new provider needs none."""

    __slots__ = ()

    ANTHROPIC: ClassVar[ProviderAPI]
    OPENAI_CHAT: ClassVar[ProviderAPI]
    OPENAI_RESPONSES: ClassVar[ProviderAPI]
    GEMINI: ClassVar[ProviderAPI]

    _interned: ClassVar[dict[str, ProviderAPI]] = {}  # one object per name, as an enum member is

    def __new__(cls, name: str) -> ProviderAPI:
        found = cls._interned.get(name) if isinstance(name, str) else None
        if found is not None:
            return found
        if not isinstance(name, str) or not _PROVIDER_NAME.fullmatch(name):
            raise ValueError(f"a provider API name is lowercase letters, digits and _ (e.g. openai_chat), got {name!r}")
        made = cls._interned[name] = super().__new__(cls, name)
        return made

    @property
    def value(self) -> str:
        """The name as a plain ``str`` (what the enum this replaced offered)."""
        return str.__str__(self)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=core_schema.to_string_ser_schema())


ProviderAPI.ANTHROPIC = ProviderAPI("anthropic")
ProviderAPI.OPENAI_CHAT = ProviderAPI("openai_chat")
ProviderAPI.OPENAI_RESPONSES = ProviderAPI("openai_responses")
ProviderAPI.GEMINI = ProviderAPI("gemini")


class Status(enum.StrEnum):
    """The one outcome vocabulary of sessions, trajectories, traces, evaluations and exports.

    A session (and its trajectory) ends ``completed``, ``timeout``, ``error`` or ``cancelled``
    (``SESSION_STATUSES``); why it did not complete is its ``FailureKind``. ``truncated`` is a trace's
    finish, never a session's: the trace's last call stopped at the token cap or the builder cut the
    chain there (slime's ``Sample.Status.TRUNCATED``); the session it belongs to still completed.
    Files written before this vocabulary said ``aborted`` for ``cancelled``: they load as ``cancelled``.
    """

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"

    @classmethod
    def _missing_(cls, value: object) -> Status | None:
        return cls.CANCELLED if value == "aborted" else None  # old journals, trajectory and outcome files


SESSION_STATUSES = frozenset({Status.COMPLETED, Status.TIMEOUT, Status.ERROR, Status.CANCELLED})


class FailureKind(enum.StrEnum):
    """Why a session did not yield a clean, evaluated result: a small fixed set a trainer can group and
    mask by (the free text goes in ``failure_detail``)."""

    AGENT_TIMEOUT = "agent_timeout"  # the harness ran past the task's timeout_s of its own time (engine time not counted)
    HARNESS_ERROR = "harness_error"  # the harness exited non-zero or could not be launched
    INIT_ERROR = "init_error"  # the runtime or the harness install failed (or timed out) before RUNNING
    ENGINE_ERROR = "engine_error"  # the engine failed or was unreachable (the gateway answered errors)
    ENGINE_BOUND_TIMEOUT = "engine_bound_timeout"  # the wall ceiling passed while the engine held the calls
    NO_MODEL_CALLS = "no_model_calls"  # the harness ended without one captured call: it never reached the gateway
    LIMIT_EXCEEDED = "limit_exceeded"  # a RuntimeSpec limit (pids, memory, disk, output, patch) was hit
    EVALUATOR_ERROR = "evaluator_error"  # grading itself failed (not a wrong fix: that is reward 0)
    EVALUATION_TIMEOUT = "evaluation_timeout"  # grading ran past its timeout (the agent's change can hang the tests)
    TAMPERED = "tampered"  # the grader's canaries or authenticated report show the test run was tampered with
    BUILD_ERROR = "build_error"  # the captured calls could not be built into a trajectory
    CANCELLED = "cancelled"  # the trainer or the task API cancelled it (e.g. slime's abort, early stop)
    INTERRUPTED = "interrupted"  # the job was stopped (SIGINT/SIGTERM, node shutdown); --resume runs it again
    NODE_LOST = "node_lost"  # the gateway node died or failed; rebuilt from its store


MASKED_KINDS = frozenset({
    FailureKind.INIT_ERROR, FailureKind.ENGINE_ERROR, FailureKind.ENGINE_BOUND_TIMEOUT, FailureKind.NO_MODEL_CALLS,
    FailureKind.EVALUATOR_ERROR, FailureKind.BUILD_ERROR, FailureKind.CANCELLED, FailureKind.INTERRUPTED,
    FailureKind.NODE_LOST,
})
"""Failures that say nothing about the policy: the environment failed or the run was not finished."""


def masked(kind: FailureKind | None, trainable_tokens: int) -> bool:
    """The one rule for ``mask`` (a trainer drops the sample from the loss; slime ``remove_sample``,
    NeMo Gym ``mask_sample``): nothing sampled to train on, or a failure in ``MASKED_KINDS``.

    Not masked, trained with their (zero) reward: ``agent_timeout``, ``harness_error``,
    ``limit_exceeded``, ``evaluation_timeout`` and ``tampered`` with captured tokens. Each is the policy's own
    doing (it ran too long, broke its harness, exhausted its sandbox, made the tests hang); masking
    them would let the policy escape a zero reward by misbehaving. A masked sample still keeps its
    row, so groups stay complete (slime counts it in the group's shape, not in its statistics).
    """
    return trainable_tokens == 0 or kind in MASKED_KINDS


LogprobsMode = Literal["processed", "raw"]
"""``processed``: logprobs of the distribution actually sampled (after temperature/top-p).
``raw``: log-softmax of the raw logits (vLLM's default ``--logprobs-mode raw_logprobs``)."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="python"))

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.model_validate(orjson.loads(data))


class ToolCall(_Record):
    """One tool call as the engine produced it; ``arguments`` is the JSON text, unmodified."""

    id: str
    name: str
    arguments: str


class AssistantMessage(_Record):
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatRequest(_Record):
    """The normalized OpenAI-Chat request every provider is translated to.

    ``messages`` and ``tools`` stay OpenAI wire dicts: harnesses send fields we do not model and
    engines' templates may use them. ``prompt_ids`` asks for token-in generation (the engine skips
    templating). ``extra_body`` passes engine-specific fields through untouched.
    """

    model: str = ""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    prompt_ids: list[int] | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)


class Generation(_Record):
    """What an engine returns for one chat request: the parsed message plus exact token data."""

    message: AssistantMessage
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None = None
    model: str = ""
    engine: str = ""
    weight_version: str | None = None
    logprobs_mode: LogprobsMode = "processed"

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        if len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs ({len(self.response_logprobs)}) must align 1:1 with "
                f"response_ids ({len(self.response_ids)})"
            )
        return self


class Timings(_Record):
    """Wall-clock facts about one captured call (epoch seconds and milliseconds)."""

    received_at: float
    engine_ms: float = 0.0
    total_ms: float = 0.0


class CompletionRecord(Generation):
    """One captured model call: the harness's raw request, what the engine saw, what it sampled."""

    session_id: str
    seq: int
    provider_api: ProviderAPI
    provider_request: dict[str, Any]
    chat_request: ChatRequest
    timings: Timings
    notes: list[str] = Field(default_factory=list)


class Trace(_Record):
    """One training sequence: prompt, then response tokens with a loss mask and logprobs.

    ``loss_mask`` is 1 on sampled tokens, 0 on tokens the harness or template inserted;
    ``response_logprobs`` is the sampled logprob where the mask is 1 and 0.0 elsewhere.
    ``trainable``: whether the task's reward may train it — False for a chain the harness did not
    continue (a side request, a call whose client went away, a single call off to the side); its
    tokens and mask are kept as captured and ``role`` says why (``polar_env/trajectory/lineage.py``).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    response_logprobs: list[float]
    reward: float | None = None
    status: Status = Status.COMPLETED
    trainable: bool = True
    role: str = ""  # main, branch, side_request:<name>, client_gone, uncontinued, ambiguous_sibling; "" unclassified
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.response_logprobs) != n:
            raise ValueError(
                f"loss_mask ({len(self.loss_mask)}) and response_logprobs ({len(self.response_logprobs)}) "
                f"must both match response_ids ({n})"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise ValueError("loss_mask values must be 0 or 1")
        return self


class Trajectory(_Record):
    """All traces of one rollout session, with its outcome. Every rollout session has one, with no
    traces when nothing was captured; ``failure_kind`` / ``failure_detail`` / ``mask`` are its
    session's (see ``masked``), ``group_id`` / ``sample_index`` its place in its GRPO group."""

    session_id: str
    traces: list[Trace]
    reward: float | None = None
    status: Status = Status.COMPLETED
    failure_kind: FailureKind | None = None
    failure_detail: str | None = None
    mask: bool = False
    group_id: str | None = None
    sample_index: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
