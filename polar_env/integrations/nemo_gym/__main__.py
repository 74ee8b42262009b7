"""``python -m polar_env.integrations.nemo_gym root``: print the Gym component root, for
``gym env start --search-dir "$(...)"`` or ``export NEMO_GYM_EXTRA_ROOTS="$(...)"``."""

from __future__ import annotations

import sys

from polar_env.integrations.nemo_gym import GYM_ROOT


def main(argv: list[str]) -> int:
    if argv != ["root"]:
        print("usage: python -m polar_env.integrations.nemo_gym root", file=sys.stderr)
        return 2
    print(GYM_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
