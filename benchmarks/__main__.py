"""Entry point: ``python -m benchmarks --help``."""

import sys

from benchmarks.harness import main

sys.exit(main())
