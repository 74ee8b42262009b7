"""Test doubles and test runners shipped with the package, kept out of its normal modules.

Nothing in the runtime path imports from here except ``EngineConfig(kind="simulated")`` (and so
``--engine simulated``), which builds ``SimulatedEngine`` on request:

- ``simulated_engine.SimulatedEngine``: an engine double (real template and tokenizer, scripted
  answers, simulated latency) for pipeline tests and staging benchmarks;
- ``simulated_runtime.SimulatedRuntime``: a runtime double that runs nothing, at simulated costs;
- ``harness_check``: the real-CLI matrix (``python -m polar_env.testing.harness_check``), a test
  runner for each harness CLI against the real gateway and the embedded engine.
"""
