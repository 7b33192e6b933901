"""Entry point for python -m ninfer.inspect."""

import sys

from ninfer.cli.inspect import main

if __name__ == "__main__":
    sys.exit(main())
