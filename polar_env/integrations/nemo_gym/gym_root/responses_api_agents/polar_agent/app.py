"""NeMo Gym agent server for polar_env: ``/run`` runs one Polar session for the row and returns the
Responses output items (prompt_token_ids / generation_token_ids / generation_log_probs, split so
NeMo RL's contiguity check passes) with the evaluator's reward. The logic is
``polar_env.integrations.nemo_gym.agent``; this file only adapts it to Gym's server classes.
``/v1/responses`` raises NotImplementedError (Gym's mark of an external agent loop): a Polar
session is a whole harness run, not one model call."""

from __future__ import annotations

from typing import Any

from fastapi import Body
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import (
    BaseResponsesAPIAgentConfig,
    SimpleResponsesAPIAgent,
)
from nemo_gym.openai_utils import (
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from polar_env.integrations.nemo_gym.agent import PolarGymAgent, check_polar_block, polar_env_config


class PolarAgentConfig(BaseResponsesAPIAgentConfig):
    model: str = "policy"
    polar: dict[str, Any] = Field(default_factory=dict)  # a PolarEnv config

    @field_validator("polar")
    @classmethod
    def _names_resolve(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A misspelled builder or evaluator is refused when Gym loads this config."""
        check_polar_block(value)
        return value


class PolarRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class PolarRunResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class PolarAgent(SimpleResponsesAPIAgent):
    ray_enabled = False
    config: PolarAgentConfig
    _polar: PolarGymAgent | None = PrivateAttr(default=None)

    def _agent(self) -> PolarGymAgent:
        if self._polar is None:
            from polar_env import PolarEnv
            from polar_env.journal.store import JournalStore  # Gym's server is the root: it names the store

            self._polar = PolarGymAgent(PolarEnv(polar_env_config(self.config.polar)), open_journal=JournalStore,
                                        model=self.config.model)
        return self._polar

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming = Body()) -> NeMoGymResponse:
        raise NotImplementedError("polar_agent runs whole harness sessions: POST /run")

    async def run(self, body: PolarRunRequest = Body()) -> PolarRunResponse:
        row = body.model_dump(mode="json")
        row["_ng_rollout_id"] = body.capture_rollout_id
        result = await self._agent().run(row)
        result["responses_create_params"] = body.responses_create_params
        return PolarRunResponse.model_validate(result)


if __name__ == "__main__":
    PolarAgent.run_webserver()
