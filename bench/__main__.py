"""`python -m bench [--quick] [--only GROUPS] [--json OUT] [--write-docs]`."""

from __future__ import annotations

import sys

from bench.harness import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
