"""One ``Registry`` behind every name table, and names/params checked when a config or TaskRequest is
built (issue 16, finding 1): a typo is one line naming the field, the bad value and the closest
names, long before any session starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from polar_env.engines.config import (
    ENGINES,
    EmbeddedEngineConfig,
    SimulatedEngineConfig,
    VLLMEngineConfig,
    engine_config,
)
from polar_env.env import PolarEnv, PolarEnvConfig
from polar_env.errors import ConfigError
from polar_env.evaluators import EVALUATORS, EvaluatorSpec
from polar_env.harnesses import HARNESSES, check_harness
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.providers import PROVIDERS
from polar_env.registry import NAMES_CHECKED, Registry, validation_line
from polar_env.runtimes import RUNTIMES, RuntimeSpec
from polar_env.staging.models import SessionSpec, TaskRequest
from polar_env.staging.node import NodeConfig
from polar_env.trajectory.builders import BUILDERS
from polar_env.trajectory.per_request import build_per_request

BUILDER_LINE = ("unknown builder 'prefix_merg'; did you mean 'prefix_merge'? "
                "(known: per_request, prefix_merge, prefix_merge_strict; or a pkg.module:attr import path)")


class Knob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turns: int = 1


# -- the Registry itself ---------------------------------------------------------------------------

def test_register_get_names_contains_and_the_decorator() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("plain", 1)

    @reg.register("decorated", params=Knob)
    def decorated() -> int:
        return 2

    assert reg.names() == ["decorated", "plain"] and "plain" in reg and "nope" not in reg
    assert reg.get("plain") == 1 and reg.get("decorated") is decorated  # the decorator hands it back
    assert reg.entry("decorated").params is Knob and reg.entry("plain").params is None
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("plain", 3)
    reg.register("plain", 3, replace=True)
    assert reg["plain"] == 3


def test_unknown_names_are_one_line_with_the_closest() -> None:
    with pytest.raises(ConfigError) as info:
        BUILDERS.get("prefix_merg")
    assert str(info.value) == BUILDER_LINE
    reg: Registry[int] = Registry("widget")
    reg.register("alpha", 1)
    with pytest.raises(ConfigError) as far:
        reg.get("zzz")
    assert str(far.value) == "unknown widget 'zzz' (known: alpha)"  # nothing close: no guess


def test_import_paths_where_the_registry_loads_them() -> None:
    loading: Registry[object] = Registry("widget", load=lambda obj, ref: obj)
    assert loading.get("polar_env.trajectory.per_request:build_per_request") is build_per_request
    with pytest.raises(ConfigError, match="cannot import widget 'polar_env.trajectory.per_request:nope'"):
        loading.get("polar_env.trajectory.per_request:nope")
    plain: Registry[object] = Registry("widget")
    with pytest.raises(ConfigError, match="unknown widget"):
        plain.get("polar_env.trajectory.per_request:build_per_request")  # a registry without a loader never imports
    assert BUILDERS.get("polar_env.trajectory.per_request:build_per_request").build is build_per_request


def test_params_are_checked_by_the_entry_model() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("w", 1, params=Knob)
    assert reg.check_params("w", {"turns": 3}) == Knob(turns=3)
    with pytest.raises(ConfigError) as info:
        reg.check_params("w", {"turns": "many"})
    assert str(info.value).startswith("params of widget 'w': turns: Input should be a valid integer")
    assert "(got 'many')" in str(info.value)


def test_every_table_is_a_registry() -> None:
    for table in (PROVIDERS, ENGINES, RUNTIMES, HARNESSES, BUILDERS, EVALUATORS):
        assert isinstance(table, Registry)
    assert set(PROVIDERS.names()) == {"anthropic", "gemini", "openai_chat", "openai_responses"}
    assert ENGINES.names() == ["embedded", "sglang", "simulated", "vllm"]
    assert RUNTIMES.names() == ["apptainer", "docker", "sandbox"]
    assert {"claude_code", "pi", "mini_swe_agent"} <= set(HARNESSES.names())
    assert EVALUATORS.entry("output").params is not None and EVALUATORS.entry("swebench").params is not None
    # harness names, CLI short names, 'loop' and import paths keep working
    assert check_harness("loop") == "loop" and check_harness("claude") == "claude"
    assert check_harness("polar_env.harnesses.pi:SPEC") == "polar_env.harnesses.pi:SPEC"


def test_validation_line_names_path_value_and_fix() -> None:
    with pytest.raises(ValidationError) as info:
        PolarEnvConfig.model_validate({"limits": {"max_running": "lots"}, "nodes": 0.5})
    line = validation_line(info.value)
    assert "\n" not in line
    assert line.startswith("limits.max_running: Input should be a valid integer") and "(got 'lots')" in line
    assert line.endswith("(and 1 more problem)")
    with pytest.raises(ValidationError) as extra:
        PolarEnvConfig.model_validate({"harnes": "pi"})
    assert validation_line(extra.value) == "harnes: not a known setting (check the spelling, or remove it)"
    # with the model, a misspelled key gets the closest real one, through nested models and unions
    assert validation_line(extra.value, model=PolarEnvConfig).startswith(
        "harnes: not a known setting; did you mean 'harness'? (known: agent_env,")
    with pytest.raises(ValidationError) as nested:
        PolarEnvConfig.model_validate({"sampling": {"temprature": 1.0}})
    assert validation_line(nested.value, model=PolarEnvConfig) == (
        "sampling.temprature: not a known setting; did you mean 'temperature'? (known: max_tokens, temperature, top_p)")
    with pytest.raises(ValidationError) as union:
        PolarEnvConfig.model_validate({"engine": {"kind": "vllm", "url": "http://x", "seed": 3}})
    assert validation_line(union.value, model=PolarEnvConfig) == (
        "engine.vllm.seed: not a known setting (known: kind, logprobs_mode, model, template, url); "
        "'seed' is for engine kind embedded or simulated")
    with pytest.raises(ValidationError) as params:
        EvaluatorSpec.model_validate({"name": "output", "regx": "4"})
    assert "regx: not a known setting; did you mean 'regex'?" in validation_line(params.value)


# -- names and params checked at construction ---------------------------------------------------

def test_polar_env_refuses_a_misspelled_builder_or_evaluator_at_construction() -> None:
    with pytest.raises(ConfigError) as builder:
        PolarEnv({"builder": "prefix_merg"})
    assert str(builder.value) == f"PolarEnv config: builder: {BUILDER_LINE}"
    with pytest.raises(ConfigError, match=r"evaluator.name: unknown evaluator 'outptu'; did you mean 'output'\?"):
        PolarEnv({"evaluator": "outptu"})
    with pytest.raises(ConfigError, match=r"harness: unknown harness 'clade_code'; did you mean 'claude_code'\?"):
        PolarEnv({"harness": "clade_code"})
    with pytest.raises(ConfigError, match=r"runtime.kind: unknown runtime 'sandbx'; did you mean 'sandbox'\?"):
        PolarEnv({"runtime": {"kind": "sandbx"}})
    with pytest.raises(ConfigError, match=r"engine: unknown engine 'vlm'; did you mean 'vllm'\?"):
        PolarEnv({"engine": {"kind": "vlm"}})


def test_a_yaml_config_is_refused_when_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "env.yaml"
    path.write_text("harness: loop\nbuilder: prefix_merg\n")
    with pytest.raises(ConfigError) as info:
        PolarEnv.from_yaml(path)
    assert str(info.value) == f"config file {path}: builder: {BUILDER_LINE}"
    path.write_text("evaluator: {name: outptu}\n")
    with pytest.raises(ConfigError, match="did you mean 'output'"):
        PolarEnvConfig.from_yaml(path)


def test_task_requests_are_refused_when_built() -> None:
    row = {"task_id": "t", "instruction": "do it"}
    with pytest.raises(ValidationError) as builder:
        TaskRequest.model_validate({**row, "builder": "prefix_merg"})
    assert validation_line(builder.value) == f"builder: {BUILDER_LINE}"
    with pytest.raises(ValidationError) as harness:
        TaskRequest.model_validate({**row, "agent": {"harness": "clade_code"}})
    assert validation_line(harness.value).startswith("agent.harness: unknown harness 'clade_code'; did you mean 'claude_code'?")
    with pytest.raises(ValidationError) as evaluator:
        TaskRequest.model_validate({**row, "evaluator": {"name": "outptu"}})
    assert validation_line(evaluator.value).startswith("evaluator.name: unknown evaluator 'outptu'; did you mean 'output'?")
    assert TaskRequest.model_validate({**row, "agent": {"harness": "loop"}, "builder": "per_request"}).builder == "per_request"


def test_evaluator_params_of_the_wrong_type_are_refused_at_construction() -> None:
    with pytest.raises(ValidationError) as info:
        EvaluatorSpec.model_validate({"name": "output", "command": "true", "exit_code": "zero"})
    assert validation_line(info.value).startswith("params of evaluator 'output': exit_code: Input should be a valid integer")
    with pytest.raises(ValidationError, match="give exactly one of regex, exact, json, command"):
        EvaluatorSpec.model_validate({"name": "output"})
    with pytest.raises(ValidationError, match="timeout_s"):
        EvaluatorSpec.model_validate({"name": "swebench", "params": {"timeout_s": "long"}})
    with pytest.raises(ValidationError, match="session_completion"):
        EvaluatorSpec.model_validate({"name": "session_completion", "regex": "x"})  # it takes no params
    with pytest.raises(ConfigError, match="params of evaluator 'output'"):
        PolarEnv({"evaluator": {"name": "output", "regex": 42}})
    assert EvaluatorSpec.model_validate({"name": "output", "regex": "4[0-9]"}).params == {"regex": "4[0-9]"}


def test_a_misspelled_param_lists_the_names_a_user_writes() -> None:
    """``json`` is the output evaluator's key (the field is ``json_`` around the builtin)."""
    with pytest.raises(ConfigError) as info:
        PolarEnv({"evaluator": {"name": "output", "regx": "ok"}})
    line = str(info.value)
    assert "did you mean 'regex'?" in line and "json," in line and "json_" not in line, line


def test_a_custom_evaluator_params_model_is_checked() -> None:
    saved = EVALUATORS.snapshot()
    try:
        @EVALUATORS.register("knobbed", params=Knob)
        async def knobbed(ctx: object) -> object:
            raise AssertionError("never run")

        assert EvaluatorSpec(name="knobbed", params={"turns": 2}).params == {"turns": 2}
        with pytest.raises(ValidationError, match="turns"):
            EvaluatorSpec(name="knobbed", params={"turns": "x"})
    finally:
        EVALUATORS.restore(saved)


def test_names_checked_context_skips_a_second_check() -> None:
    """A node in another process deserializes a spec whose custom names it may not know."""
    spec = {"session_id": "s", "sample_index": 0, "group_id": "g",
            "request": {"task_id": "t", "instruction": "i", "evaluator": {"name": "only_in_the_submitter"}}}
    with pytest.raises(ValidationError):
        SessionSpec.model_validate(spec)
    assert SessionSpec.model_validate(spec, context=NAMES_CHECKED).request.evaluator is not None


def test_a_harness_file_is_read_when_the_config_is_built_not_per_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import polar_env.harnesses as harnesses
    from polar_env.env import task_request

    path = tmp_path / "my-agent.json"
    path.write_text('{"name": "my-agent", "command": ["my-agent", "{prompt}"]}')
    reads: list[Path] = []
    real = harnesses.load_harness_file
    monkeypatch.setattr(harnesses, "load_harness_file", lambda p: reads.append(p) or real(p))
    config = PolarEnvConfig(harness=str(path))
    assert reads == [path]
    reqs = [task_request({"task_id": f"t{i}", "instruction": "i"}, config, 1) for i in range(20)]
    assert reads == [path] and {r.agent.harness for r in reqs} == {str(path)}


# -- one config tree ------------------------------------------------------------------------------

def test_engine_config_is_a_union_by_kind() -> None:
    assert isinstance(engine_config({}), EmbeddedEngineConfig)  # no kind: the embedded default
    assert isinstance(PolarEnvConfig.model_validate({"engine": {"seed": 3}}).engine, EmbeddedEngineConfig)
    cfg = PolarEnvConfig.model_validate({"engine": {"kind": "vllm", "url": "http://127.0.0.1:8000", "model": "m"}})
    assert isinstance(cfg.engine, VLLMEngineConfig) and cfg.engine.describe() == "vllm at http://127.0.0.1:8000"
    with pytest.raises(ValidationError) as info:
        PolarEnvConfig.model_validate({"engine": {"kind": "vllm", "url": "http://x", "seed": 3}})
    assert validation_line(info.value) == "engine.vllm.seed: not a known setting (check the spelling, or remove it)"
    with pytest.raises(ValidationError, match="unknown template 'qwen9'"):
        engine_config({"kind": "sglang", "template": "qwen9"})


def test_the_node_and_gateway_configs_come_from_the_tree() -> None:
    env = PolarEnvConfig.model_validate({"engine": {"kind": "simulated", "template": "append_only"},
                                         "sampling": {"temperature": 0.5, "max_tokens": 32}, "harness": "loop"})
    node = env.cluster().node
    assert node.sampling is env.sampling and node.engine == env.engine  # the sub-models, not copies of fields
    gateway = node.gateway_config("served")
    assert isinstance(gateway, GatewayConfig) and gateway.sampling == Sampling(temperature=0.5, max_tokens=32)
    assert gateway.engine_model == "served" and gateway.template == "append_only"
    # the embedded engine's per-call cap is the default of the one setting, sampling.max_tokens
    embedded = NodeConfig(engine=EmbeddedEngineConfig())
    assert embedded.gateway_config("m").sampling.max_tokens == 256
    assert embedded.gateway_config("m", own_engine=False).sampling.max_tokens is None
    scripted = NodeConfig(engine=EmbeddedEngineConfig(script=Path("s.json")))
    assert scripted.gateway_config("m").sampling.max_tokens == 4096
    assert NodeConfig(engine=SimulatedEngineConfig()).gateway_config("m").sampling.max_tokens is None


def test_old_sampling_names_point_at_the_new_one() -> None:
    with pytest.raises(ValidationError) as info:
        PolarEnvConfig.model_validate({"temperature": 0.7})
    assert "'temperature' is now sampling.temperature" in validation_line(info.value)
    with pytest.raises(ValidationError):
        engine_config({"kind": "embedded", "max_tokens_cap": 4})  # one name: sampling.max_tokens


def test_runtime_kinds_come_from_the_table() -> None:
    assert RuntimeSpec(kind="docker").kind == "docker"
    with pytest.raises(ValidationError, match="did you mean 'docker'"):
        RuntimeSpec(kind="dockr")


def test_the_adapters_refuse_a_wrong_name_before_any_session(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from polar_env.integrations.nemo_gym.agent import check_polar_block
    from polar_env.integrations.slime import polar_config

    with pytest.raises(ValueError, match=r"^polar.builder: unknown builder 'prefix_merg'; did you mean 'prefix_merge'\?"):
        check_polar_block({"harness": "loop", "builder": "prefix_merg",
                           "engine": {"kind": "vllm", "url": "http://127.0.0.1:9/v1"}})
    assert check_polar_block({"harness": "loop", "engine": {"kind": "vllm", "url": ["http://h:1/v1"]}})
    # slime's generate builds its PolarEnv from polar.yaml on the first call: refused there, no session
    (tmp_path / "polar.yaml").write_text("harness: loop\nevaluator: {name: outptu}\nengine: {kind: embedded, seed: 1}\n")
    args = SimpleNamespace(polar_config=str(tmp_path / "polar.yaml"), sglang_router_ip="127.0.0.1", sglang_router_port=1)
    config = polar_config(args)
    assert config["engine"] == {"kind": "sglang", "url": "router:http://127.0.0.1:1"}  # embedded-only seed dropped
    with pytest.raises(ConfigError, match=r"evaluator.name: unknown evaluator 'outptu'; did you mean 'output'\?"):
        PolarEnv(config)


def test_a_harness_that_does_not_speak_the_api_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"^PolarEnv config: api: harness 'claude_code' does not speak gemini "
                                          r"\(it speaks: anthropic\)$"):
        PolarEnv({"harness": "claude_code", "api": "gemini"})
    with pytest.raises(ValidationError, match="does not speak openai_chat"):
        TaskRequest.model_validate({"task_id": "t", "instruction": "i",
                                    "agent": {"harness": "claude_code", "api": "openai_chat"}})
    assert PolarEnvConfig.model_validate({"harness": "pi", "api": "gemini"}).api == "gemini"  # pi speaks four
