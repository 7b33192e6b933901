"""Entry point for python -m ninfer.perplexity."""

import sys

from ninfer.cli.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
