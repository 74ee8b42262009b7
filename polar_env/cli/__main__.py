"""``python -m polar_env.cli``."""

import sys

from polar_env.cli import main

sys.exit(main())
