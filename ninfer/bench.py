"""Entry point for python -m ninfer.bench."""

import sys

from ninfer.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
