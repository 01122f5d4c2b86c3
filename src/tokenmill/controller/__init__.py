"""Controllers: the loops that drive generator, trainer and weight sync (the synchronous one for now)."""

from tokenmill.controller.rl import run_rl
from tokenmill.controller.setup import Run, build_run

__all__ = ["Run", "build_run", "run_rl"]
