"""Memory estimate of a post-training run, per model and per device, without loading a model.

`estimate_for_config(tree)` reads a tokenmill config dict (the YAML that `tokenmill train|sft|preference`
reads, plus optional `mode:` and `estimate:` keys) and answers in JSON; `MemoryPlan` -> `estimate()` /
`solve_budget()` is the lower-level API. Nothing here imports torch or the Composer.
"""

from tokenmill.estimate.config import EstimateOptions, estimate_for_config, plan_from_config
from tokenmill.estimate.memory import MemoryEstimate, MemoryPlan, estimate, recommend_backend, solve_budget
from tokenmill.estimate.model_specs import ModelShape, resolve_shape

__all__ = [
    "EstimateOptions",
    "MemoryEstimate",
    "MemoryPlan",
    "ModelShape",
    "estimate",
    "estimate_for_config",
    "plan_from_config",
    "recommend_backend",
    "resolve_shape",
    "solve_budget",
]
