"""Controllers: the loop that drives generator, trainer and weight sync (`rl.py`), fed in place (colocated) or
by a rollout producer running ahead within `controller.max_staleness` (`async_rl.py`, engines placed by
`placement.py`); proxy-mode training (`proxy_rl.py`)."""

from tokenmill.controller.rl import run_rl
from tokenmill.controller.setup import Run, build_run

__all__ = ["Run", "build_run", "run_rl"]
