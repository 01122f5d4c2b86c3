"""`POST /api/placement`: where a `cluster: {backend: ray}` config runs each role, per node and device: the planner
`tokenmill plan` prints (`config.cluster.make_plan`), nothing started. The Composer draws it beside the memory
estimate; a layout that does not fit is answered with the planner's message (naming the field), not an error
status, so the page can show it next to the config."""

from __future__ import annotations

from typing import Any

from tokenmill.composer import configs
from tokenmill.config.cluster import placement_of_config
from tokenmill.types import ConfigError


def placement_answer(mode: str, cfg: Any) -> dict[str, Any]:
    """{"backend": "local", "message"} for a config Ray does not place; else {"backend": "ray"} with the plan's
    `lines` and `layout` (each node with its slots, where each role runs), or its refusal as `error`."""
    if mode != "rl" or cfg.cluster.backend != "ray":
        return {"backend": "local", "message": "one process (or the ranks torchrun starts); set cluster.backend: "
                "ray to place ranks, roles and engines on a Ray cluster"}
    try:
        plan = placement_of_config(configs.normalized(cfg))
    except ConfigError as exc:
        return {"backend": "ray", "error": str(exc)}
    return {"backend": "ray", "lines": plan["lines"], "layout": plan["layout"]}
