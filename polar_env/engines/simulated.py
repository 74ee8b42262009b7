"""``SimulatedEngine``: a test double for pipeline tests and benchmarks, named as one.

It answers like the embedded engine in scripted mode, without a model: the prompt is rendered with
the real chat format (Qwen3.5 by default) (so prompt ids, prefix merging and continuation behave as
with a real engine), the scripted turn is tokenized as the model would write it, every sampled
token gets a fixed logprob, and the answer arrives after ``latency_s`` of simulated generation.
Use it to measure staging and gateway overhead; real token data comes from ``embedded``/vLLM/SGLang.
"""

from __future__ import annotations

import asyncio
import random

from polar_env.chat import ChatFormat, chat_format
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.records import ChatRequest, Generation

SIMULATED_LOGPROB = -0.125


class SimulatedEngine:
    name = "simulated"

    def __init__(self, *, latency_s: float = 0.05, jitter: float = 0.0, policy: ScriptedPolicy | None = None,
                 chat: ChatFormat | None = None, model_name: str = "simulated", seed: int = 0) -> None:
        self.latency_s = latency_s
        self.jitter = jitter
        self.policy = policy or ScriptedPolicy()
        self.chat = chat or chat_format("qwen3.5")
        self.model_name = model_name
        self.tokenizer = self.chat.tokenizer
        self.weight_version = 0
        self._rng = random.Random(seed)

    async def generate(self, request: ChatRequest) -> Generation:
        thinking = request.chat_template_kwargs.get("enable_thinking", True) is not False
        if request.prompt_ids is not None:
            prompt_ids = list(request.prompt_ids)
        else:
            text = self.chat.render(request.messages, request.tools, enable_thinking=thinking)
            prompt_ids = self.tokenizer.encode(text)
        body = self.policy.response_text(request.messages, request.tools, thinking=thinking, chat=self.chat)
        response_ids = self.tokenizer.encode(body) + [self.chat.end_of_turn_id]
        delay = self.latency_s * (1 + self.jitter * (2 * self._rng.random() - 1))
        await asyncio.sleep(max(0.0, delay))
        message = self.chat.parse(body, tools=request.tools, thinking=self.chat.opens_thinking(prompt_ids))
        return Generation(
            message=message, prompt_ids=prompt_ids, response_ids=response_ids,
            response_logprobs=[SIMULATED_LOGPROB] * len(response_ids),
            finish_reason="tool_calls" if message.tool_calls else "stop", model=self.model_name,
            engine=self.name, weight_version=str(self.weight_version),
        )

    async def aclose(self) -> None:
        return None
