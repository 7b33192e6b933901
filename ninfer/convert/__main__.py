"""Entry point for python -m ninfer.convert."""

import sys

from ninfer.cli.convert import main

sys.exit(main())
