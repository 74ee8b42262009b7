"""Test doubles and test runners shipped with the package, kept out of its normal modules.

Nothing in the runtime path imports from here (this package sits above every other layer). The
engine double, ``SimulatedEngine`` (``--engine simulated``), is an engine kind and lives with the
engines (``polar_env/engines/simulated.py``).

- ``simulated_runtime.SimulatedRuntime``: a runtime double that runs nothing, at simulated costs;
- ``harness_check``: the real-CLI matrix (``python -m polar_env.testing.harness_check``), a test
  runner for each harness CLI against the real gateway and the embedded engine.
"""
