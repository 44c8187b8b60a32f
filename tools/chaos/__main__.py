"""python -m tools.chaos [--minutes 5] [--clients 12] [--seed N]: soak.py."""

import sys

from .soak import main

sys.exit(main())
