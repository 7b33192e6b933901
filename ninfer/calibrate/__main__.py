"""Entry point for python -m ninfer.calibrate."""

import sys

from ninfer.cli.calibrate import main

sys.exit(main())
