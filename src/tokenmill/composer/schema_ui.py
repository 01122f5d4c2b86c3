"""The config schema as form fields: pydantic JSON Schema -> flat fields with a level, a group and help text.

Why a level table here and not tags in `config/schema.py`: the schema is shared by every run mode, and what
a beginner must see differs per mode (a learning rate is "simple" everywhere, `data.task_reward_weight` only
matters for RL). Fields not named below are "expert". Levels nest: simple ⊂ advanced ⊂ expert.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tokenmill.config.modes import MODES
from tokenmill.data.registry import task_names

LEVELS = ("simple", "advanced", "expert")

# Per mode: the fields a first run needs (simple) and the ones a tuned run touches (advanced).
_SIMPLE = {
    "rl": ["model.path", "model.lora.rank", "data.task", "data.path", "rewards", "generation.group_size",
           "generation.max_tokens", "generation.temperature", "algorithm.advantage", "algorithm.kl_coef",
           "training.learning_rate", "controller.steps", "controller.prompts_per_step"],
    "preference": ["model.path", "model.lora.rank", "data.task", "data.path", "objective", "beta", "steps",
                   "batch_size", "learning_rate", "output_dir"],
    "reward_model": ["model.path", "data.task", "data.path", "steps", "batch_size", "learning_rate",
                     "warmup_steps", "output_dir"],
    "sft": ["model.path", "model.lora.rank", "data.task", "data.path", "data.prompt_column",
            "completion_column", "messages_column", "steps", "batch_size", "learning_rate", "output_dir"],
}
_ADVANCED = {
    "rl": ["model.device", "model.dtype", "model.lora.alpha", "model.lora.target_modules", "data.split",
           "data.prompt_column", "data.num_eval", "data.task_reward_weight", "generation.top_p",
           "generation.top_k", "generation.stop", "algorithm.loss", "algorithm.loss_agg", "algorithm.clip_low",
           "algorithm.clip_high", "algorithm.scale_rewards", "algorithm.entropy_coef", "algorithm.ppo_epochs",
           "algorithm.mini_batches", "algorithm.dynamic_sampling", "algorithm.overlong_buffer",
           "critic.learning_rate", "critic.warmup_steps", "training.warmup_steps", "training.lr_schedule",
           "training.max_grad_norm", "training.weight_decay", "training.micro_batch_tokens", "training.seed",
           "controller.eval_every", "tracking.output_dir", "tracking.log_samples", "checkpoint.every",
           "checkpoint.resume", "env.name", "env.max_turns", "engine.placement", "controller.max_staleness",
           # what a run of 2026 tunes (issue 38): off-policy correction and its masks, MoE router replay,
           # step-wise agent samples (proxy.stepwise stays with the rest of the proxy section, at expert)
           "algorithm.off_policy", "algorithm.is_cap", "algorithm.mask_low", "algorithm.mask_high",
           "algorithm.mask_kl", "training.router_replay", "env.stepwise"],
    "preference": ["model.device", "model.dtype", "model.lora.alpha", "model.lora.target_modules",
                   "data.split", "data.num_train", "data.num_eval", "warmup_steps", "lr_schedule", "max_grad_norm",
                   "weight_decay", "seed"],
    "reward_model": ["model.device", "model.dtype", "data.split", "data.num_train", "data.num_eval", "lr_schedule",
                     "max_grad_norm", "weight_decay", "seed"],
    "sft": ["model.device", "model.dtype", "model.lora.alpha", "model.lora.target_modules", "data.split",
            "data.num_train", "packing", "micro_batch_tokens", "warmup_steps", "lr_schedule", "max_grad_norm",
            "weight_decay", "seed"],
}
# on-policy distillation: routing rows between several teachers, and the policy as its own teacher
_ADVANCED["rl"] += ["distillation.route_by", "distillation.routes", "distillation.route_default",
                    "distillation.self_teacher.template", "distillation.self_teacher.snapshot",
                    "distillation.teacher_tokenizer"]
# Fields a mode fixes itself (`Mode.fixed`) are not shown, nor beta, which only DPO / IPO / SimPO read.
_HIDDEN = {"reward_model": {"objective", "beta"}}
_PREFERENCE_OBJECTIVES = ["dpo", "ipo", "simpo"]
_GROUP_TITLES = {"model": "Model", "data": "Data", "env": "Environment", "generation": "Generation",
                 "rewards": "Rewards", "algorithm": "Algorithm", "critic": "Critic (PPO)",
                 "training": "Training", "controller": "Loop", "tracking": "Tracking",
                 "checkpoint": "Checkpoints", "engine": "Engine", "run": "Run"}
_CONSTRAINTS = {"minimum": "minimum", "maximum": "maximum", "exclusiveMinimum": "exclusive_minimum",
                "exclusiveMaximum": "exclusive_maximum"}


def schema_for(mode: str) -> type[BaseModel]:
    if mode not in MODES:
        raise ValueError(f"mode: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return MODES[mode].schema


def fixed_values(mode: str) -> dict[str, Any]:
    """Top-level values the mode sets itself (merged into every config of that mode)."""
    return dict(MODES[mode].fixed)


def level_of(mode: str, path: str) -> str:
    if path in _SIMPLE[mode]:
        return "simple"
    if path in _ADVANCED[mode]:
        return "advanced"
    return "expert"


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref:
        target = dict(defs[ref.rsplit("/", 1)[-1]])
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _non_null(node: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The alternatives of a field other than null, and whether null is allowed."""
    options = node.get("anyOf") or node.get("oneOf")
    if not options:
        return [node], node.get("type") == "null"
    rest = [o for o in options if o.get("type") != "null"]
    return rest, len(rest) < len(options)


def _describe_type(options: list[dict[str, Any]], nullable: bool) -> dict[str, Any]:
    """type / enum / items / constraints of a leaf field."""
    if len(options) != 1:
        return {"type": "json"}
    node = options[0]
    out: dict[str, Any] = {}
    if "enum" in node or "const" in node:
        choices = list(node.get("enum", [node.get("const")]))
        out |= {"type": "enum", "enum": choices + ([None] if nullable else [])}
    elif node.get("type") == "array":
        items = node.get("items") or (node.get("prefixItems") or [{}])[0]
        out |= {"type": "list", "items": items.get("type", "json") if isinstance(items, dict) else "json"}
    elif node.get("type") == "object":
        out["type"] = "object"
    elif node.get("type") in ("integer", "number", "string", "boolean"):
        out["type"] = node["type"]
    else:
        out["type"] = "json"
    for key, name in _CONSTRAINTS.items():
        if key in node:
            out[name] = node[key]
    return out


def _is_section(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and "properties" in node


def _walk(node: dict[str, Any], defs: dict[str, Any], prefix: str, optional: str | None,
          required: set[str], out: list[dict[str, Any]]) -> None:
    for name, raw in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        field = _resolve(raw, defs)
        options, nullable = _non_null(field)
        section = [_resolve(o, defs) for o in options]
        if len(section) == 1 and _is_section(section[0]):  # a sub-config: flatten its fields
            sub_optional = optional or (path if nullable else None)
            _walk(section[0], defs, f"{path}.", sub_optional, set(section[0].get("required", [])), out)
            continue
        if path == "rewards":  # a list of tagged unions: edited in the Rewards panel
            kind: dict[str, Any] = {"type": "list", "items": "reward"}
        elif path == "data.task" and "addition" not in str(section):  # free text in the schema, checked later
            kind = {"type": "enum", "enum": [*task_names(), None]}
        else:
            kind = _describe_type(section, nullable)
        # default_factory fields have no "default" in the JSON schema: an empty list / mapping
        empty = {"list": [], "object": {}}.get(kind["type"]) if name not in required else None
        out.append({
            "path": path, "group": path.split(".")[0] if "." in path or path == "rewards" else "run",
            "default": field.get("default", empty), "description": field.get("description", ""),
            "required": name in required, "nullable": nullable, "minimum": None, "maximum": None,
            "exclusive_minimum": None, "exclusive_maximum": None, "enum": None, "items": None,
            "optional_section": optional, **kind,
        })


def schema_fields(mode: str) -> list[dict[str, Any]]:
    """Every leaf field of the mode's config, in schema order, with its level."""
    schema = schema_for(mode).model_json_schema()
    fields: list[dict[str, Any]] = []
    _walk(schema, schema.get("$defs", {}), "", None, set(schema.get("required", [])), fields)
    hidden = _HIDDEN.get(mode, set())
    fields = [f for f in fields if f["path"] not in hidden]
    for f in fields:
        f["level"] = level_of(mode, f["path"])
        if mode == "preference" and f["path"] == "objective":
            f["enum"] = list(_PREFERENCE_OBJECTIVES)
    return fields


def _groups(schema: type[BaseModel], fields: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: list[str] = []
    for f in fields:
        if f["group"] not in seen:
            seen.append(f["group"])
    descriptions: dict[str, str] = {}
    for name, info in schema.model_fields.items():
        sub = info.annotation
        doc = info.description or (getattr(sub, "__doc__", None) if isinstance(sub, type) else None) or ""
        descriptions[name] = " ".join(doc.split())
    return [{"id": g, "title": _GROUP_TITLES.get(g, g.replace("_", " ").title()),
             "description": descriptions.get(g, "")} for g in seen]


def schema_response(mode: str) -> dict[str, Any]:
    """The body of GET /api/schema."""
    fields = schema_fields(mode)
    return {
        "mode": mode,
        "modes": [{"id": m.id, "title": m.title, "command": m.command} for m in MODES.values()],
        "levels": list(LEVELS),
        "groups": _groups(schema_for(mode), fields),
        "fields": fields,
    }
