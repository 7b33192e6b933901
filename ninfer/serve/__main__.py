"""Entry point for python -m ninfer.serve."""

import sys

from ninfer.cli.serve import main

sys.exit(main())
