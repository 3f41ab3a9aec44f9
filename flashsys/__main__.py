"""`python -m flashsys`: see flashsys.cli."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
