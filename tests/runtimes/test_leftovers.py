"""Runtime folders a dead node process left are swept; a live process's folders never are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from polar_env.runtimes import leftovers


def test_sweep_removes_only_what_dead_processes_left(tmp_path: Path) -> None:
    live = leftovers.claim(tmp_path, "node-0")
    (live.path / "polar-sandbox-live").mkdir()
    code = ("import sys, time; from pathlib import Path; from polar_env.runtimes import leftovers; "
            "inc = leftovers.claim(Path(sys.argv[1]), 'node-0'); (inc.path / 'polar-sandbox-dead' / 'repo').mkdir(parents=True); "
            "import tempfile; (Path(tempfile.gettempdir()) / 'polar-stage-polar-sandbox-dead' / 'r').mkdir(parents=True); "
            "print(inc.path, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    dead = Path(proc.stdout.readline().strip())
    assert (dead / "polar-sandbox-dead" / "repo").is_dir()
    assert leftovers.sweep(tmp_path) == []  # both owners alive
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    time.sleep(0.1)
    assert leftovers.sweep(tmp_path) == [str(dead)]
    assert not dead.exists() and (live.path / "polar-sandbox-live").is_dir()
    import tempfile

    assert not (Path(tempfile.gettempdir()) / "polar-stage-polar-sandbox-dead").exists()
    live.release()
    assert not live.path.exists()
