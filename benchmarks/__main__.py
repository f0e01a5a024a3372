"""Entry point: ``python -m benchmarks``."""

import sys

from .runner import main

sys.exit(main())
