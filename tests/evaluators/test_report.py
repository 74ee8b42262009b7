"""The evaluation report is typed (``EvalReport``) without changing a byte of what is written:
``EvalResult`` validates and serializes it as the plain JSON object it is."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, Field, ValidationError

from polar_env.evaluators import EvalResult
from polar_env.staging.models import SessionResult


class PlainReport(BaseModel):
    """What ``EvalResult.report`` was before it was typed: the reference for the bytes."""

    report: dict[str, Any] = Field(default_factory=dict)


def test_a_report_passes_untouched_whatever_its_keys_and_value_types() -> None:
    # a custom evaluator's own key, an int where EvalReport says float, None where it says str
    report: Any = {"reason": None, "evaluate_s": 3, "custom": {"nested": [1, "two"]}, "resolved": True}
    result = EvalResult(reward=1.0, report=report)
    assert result.report == report and list(result.report) == list(report)
    assert result.model_dump_json().endswith(PlainReport(report=report).model_dump_json()[1:])
    assert json.loads(result.model_dump_json())["report"]["evaluate_s"] == 3  # not 3.0
    assert EvalResult.model_validate_json(result.model_dump_json()).report == report


def test_a_report_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ValidationError):
        EvalResult(report=["not", "an", "object"])  # type: ignore[arg-type]


def test_the_sessions_evaluation_reads_back_as_written() -> None:
    evaluation: Any = {"status": "completed", "resolved": False, "swebench": {"tests_status": {}}, "mine": 1}
    row = {"session_id": "s", "task_id": "t", "group_id": "g", "sample_index": 0, "status": "completed",
           "evaluation": evaluation, "trajectory": {"session_id": "s", "traces": []}}
    result = SessionResult.model_validate(row)
    assert result.evaluation == evaluation
    assert SessionResult.model_validate_json(result.model_dump_json()).evaluation == evaluation
