"""Entry point for python -m ninfer.run."""

import sys

from ninfer.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
