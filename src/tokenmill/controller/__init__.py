"""Controllers: the loop that drives generator, trainer and weight sync (`rl.py`), fed in place (colocated) or
by a rollout producer running ahead within `controller.max_staleness` (`feeds.py`, engines placed by
`placement.py`); proxy-mode training (`proxy_rl.py`)."""

from tokenmill.controller.build import Run, build_run
from tokenmill.controller.rl import run_rl

__all__ = ["Run", "build_run", "run_rl"]
