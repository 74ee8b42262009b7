"""mini-swe-agent (``mini``, PyPI ``mini-swe-agent``), OpenAI Chat Completions through litellm.

Headless: ``mini -m openai/<model> -t <task> --yolo --exit-immediately --cost-limit 0``. The
``openai/`` prefix makes litellm use its OpenAI-compatible client, which reads ``OPENAI_BASE_URL``
(``.../v1``) and ``OPENAI_API_KEY`` (sent as ``Authorization: Bearer``) and sends the model id
without the prefix. The built-in ``mini.yaml`` config declares one ``bash`` tool (``command``
argument) and expects a tool call in every reply: a reply without one is a format error (three in a
row end the run). The agent finishes when a command's output starts with
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, so a scripted engine must send ``finish_command``.

No ``-c`` is passed on purpose: ``-c mini.yaml`` would first look for ``mini.yaml`` in the working
directory (the task repo). The default config is the built-in one; everything else is env:
``MSWEA_CONFIGURED`` skips the first-run setup prompt, ``MSWEA_COST_TRACKING=ignore_errors`` stops
the unknown-model cost error, ``LITELLM_LOCAL_MODEL_COST_MAP`` keeps litellm from fetching its cost
map at import, ``MSWEA_GLOBAL_CONFIG_DIR`` keeps its ``.env`` and trajectory under ``{home}``.
"""

from __future__ import annotations

from polar_env.harnesses.spec import ApiConfig, HarnessSpec, Install
from polar_env.records import ProviderAPI

FINISH_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

SPEC = HarnessSpec(
    name="mini_swe_agent",
    cli="mini",
    install=Install("pip", "mini-swe-agent", "2.4.6", binary="mini", dir="mini"),
    apis={ProviderAPI.OPENAI_CHAT: ApiConfig(
        env={
            "OPENAI_BASE_URL": "{base_url}/v1",
            "OPENAI_API_KEY": "{key}",
        },
        paths=("/v1/chat/completions",),
    )},
    default_api=ProviderAPI.OPENAI_CHAT,
    argv=("mini", "-m", "openai/{model}", "-t", "{prompt}", "--yolo", "--exit-immediately", "--cost-limit", "0",
          "-o", "{home}/.config/mini-swe-agent/last.traj.json"),
    unattended_flags=("--yolo", "--exit-immediately"),
    quiet_env={
        "HOME": "{home}",
        "MSWEA_GLOBAL_CONFIG_DIR": "{home}/.config/mini-swe-agent",
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "PYTHONUNBUFFERED": "1",
    },
    needs="python",
    finish_command=FINISH_COMMAND,
    description="SWE-agent's minimal agent (Python, litellm); one bash tool, finishes by a command.",
)
