"""The controller: one loop (`rl.py`) that drives generator, trainer and weight sync. Its feed (`feeds/`)
rolls out in place (colocated), in a producer running ahead within `controller.max_staleness` (engines placed
by `placement.py`), or takes an external agent's episodes (proxy mode). `build.py` builds a run from a config,
`evaluate.py` holds the per-step metrics and the held-out evaluation."""

from tokenmill.controller.build import Run, build_run
from tokenmill.controller.rl import run_rl

__all__ = ["Run", "build_run", "run_rl"]
