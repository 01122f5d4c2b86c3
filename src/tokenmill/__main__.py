"""`python -m tokenmill ...`: the `tokenmill` command, also as torchrun starts it on every rank
(`torchrun --standalone --nproc_per_node 2 -m tokenmill train cfg.yaml`)."""

import sys

from tokenmill.cli import main

if __name__ == "__main__":
    sys.exit(main())
