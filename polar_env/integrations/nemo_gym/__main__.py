"""``python -m polar_env.integrations.nemo_gym root``: print the Gym component root, for
``gym env start --search-dir "$(...)"`` or ``export NEMO_GYM_EXTRA_ROOTS="$(...)"``.
``requirements PYPROJECT`` and ``check-result OUT.jsonl`` are ``scripts/check_nemo_gym.sh``'s
(``check.py``): what the Gym venv installs, and the rollout's check."""

from __future__ import annotations

import sys
from pathlib import Path

from polar_env.integrations.nemo_gym import GYM_ROOT

USAGE = "usage: python -m polar_env.integrations.nemo_gym root | requirements PYPROJECT | check-result OUT.jsonl"


def main(argv: list[str]) -> int:
    from polar_env.integrations.nemo_gym.check import check_result, venv_requirements

    if argv == ["root"]:
        print(GYM_ROOT)
    elif len(argv) == 2 and argv[0] == "requirements":
        print("\n".join(venv_requirements(Path(argv[1]))))
    elif len(argv) == 2 and argv[0] == "check-result":
        print(check_result(Path(argv[1])))
    else:
        print(USAGE, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
