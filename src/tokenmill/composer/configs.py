"""Config operations behind the Composer's routes: validate with field paths, YAML export / import, and the
four-model diagram. Pure functions over the pydantic schema (no torch), so the CLI and tests can use them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.composer.schema_ui import fixed_values, schema_for
from tokenmill.config.load import format_validation_error
from tokenmill.config.modes import EXTRA_KEYS, MODES, infer_mode
from tokenmill.config.rewards import RewardFunctionConfig
from tokenmill.config.safe_yaml import load_yaml_text
from tokenmill.config.schema import RLConfig
from tokenmill.types import ConfigError


class RewardCode(BaseModel):
    """A reward function written in the page: Python source defining `function` with TRL's batched signature
    fn(prompts, completions, **columns) -> list[float | None] (or fn(prompt, completion, **row) with
    per_sample). The name is also its file name in the run folder."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", description="Name in metrics and file name.")
    code: str = Field(..., max_length=200_000, description="Python source.")
    function: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="The function to call.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight in the total reward.")
    per_sample: bool = Field(False, description="fn(prompt, completion, **row) -> float.")
    timeout_s: float = Field(10.0, gt=0, le=300, description="Seconds one batched call may take.")


def code_reward_entries(mode: str, rewards: list[RewardCode], folder: str) -> list[dict[str, Any]]:
    """The config's `rewards` entries for rewards written in the page, each saved as `<folder>/<name>.py` and
    referenced as `<folder>/<name>.py:<function>`; ValueError naming the field when they cannot be."""
    if rewards and mode != "rl":
        raise ValueError(f"rewards: only mode rl takes reward functions, not {mode}")
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise ValueError(f"rewards: names must be unique, got {names}")
    return [{"name": r.name, "function": code_reward_ref(folder, r.name, r.function), "weight": r.weight,
             "per_sample": r.per_sample, "timeout_s": r.timeout_s} for r in rewards]


def code_reward_ref(folder: str, name: str, function: str) -> str:
    """How a config names a page's reward saved as `<folder>/<name>.py`."""
    return f"{folder}/{name}.py:{function}"


def error_list(text: str) -> list[dict[str, str]]:
    """`format_validation_error` lines ("a.b: message") as [{"path", "message"}]."""
    out = []
    for line in text.splitlines():
        path, sep, message = line.partition(": ")
        out.append({"path": path, "message": message} if sep else {"path": "config", "message": line})
    return out


def validate(mode: str, config: dict[str, Any]) -> tuple[BaseModel | None, list[dict[str, str]]]:
    """The mode's config object, or None and the errors (each naming its dotted field path)."""
    schema = schema_for(mode)
    if not isinstance(config, dict):
        return None, [{"path": "config", "message": "expected a mapping of sections"}]
    if mode == "preference" and config.get("objective") == "reward_model":
        return None, [{"path": "objective", "message": "reward_model is its own mode: choose mode reward_model"}]
    try:
        return schema.model_validate({**config, **fixed_values(mode)}), []
    except ValidationError as exc:
        return None, error_list(format_validation_error(exc, schema))


def normalized(cfg: BaseModel) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def config_filename(mode: str) -> str:
    return f"{mode}.yaml"


def command_for(mode: str, filename: str) -> str:
    return f"tokenmill {MODES[mode].command} {filename}"


# the config keys that hold a local path (or a `file.py:function` reference), in every section
_PATH_KEY = ("path", "tokenizer_path", "eval_path", "function", "resume_from", "init_from")


def anchored(tree: Any, base: Path | None = None, key: str = "") -> Any:
    """`tree` with every relative path under a path key (`_PATH_KEY`) that names an existing file or folder from
    `base` (the Composer's working directory) made absolute, `file.py:function` references included: the
    exported YAML then validates from whatever folder it is saved in. Hub ids, and paths that do not exist from
    `base` (a page reward's `rewards/<name>.py`, saved beside the YAML), are left as they are."""
    base = base or Path.cwd()
    if isinstance(tree, dict):
        return {k: anchored(v, base, str(k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [anchored(v, base, key) for v in tree]
    if key not in _PATH_KEY or not isinstance(tree, str) or not tree or len(tree) > 4096:
        return tree
    head, sep, function = tree.rpartition(":") if tree.count(":") == 1 and ".py:" in tree else (tree, "", "")
    try:
        if Path(head).is_absolute() or head.startswith("~") or not (base / head).exists():
            return tree
        return str((base / head).resolve()) + sep + function
    except (OSError, ValueError):
        return tree


def export_yaml(mode: str, cfg: BaseModel) -> str:
    """The YAML that `tokenmill train|sft|preference` and `tokenmill estimate` read unchanged: its `mode:`, then
    the values that differ from the defaults (required ones always), in schema order, behind a comment naming
    the command. Local paths are absolute (`anchored`)."""
    tree = anchored({"mode": mode, **cfg.model_dump(mode="json", exclude_defaults=True)})
    tree.update(fixed_values(mode))
    header = f"# {command_for(mode, config_filename(mode))}   (written by tokenmill composer)\n"
    return header + yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


def import_yaml(text: str, mode: str | None = None,
                page_rewards: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """{"mode", "config", "errors"}: the normalized config when valid, else the raw mapping and the errors.
    The mode is `mode`, else the file's `mode:`, else inferred from its sections (`config.modes`); an
    `estimate:` section is for `tokenmill estimate` and is dropped here. Reward entries that export wrote
    for the page's own code rewards, given as (name, function), are dropped: the page holds their code."""
    try:
        tree = load_yaml_text(text)  # the CLI's bounded reader: no alias bomb, no duplicate keys
    except ConfigError as exc:
        return {"mode": mode or "rl", "config": {}, "errors": [{"path": "yaml", "message": str(exc)}]}
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        return {"mode": mode or "rl", "config": {},
                "errors": [{"path": "yaml", "message": "the top level must be a mapping of sections"}]}
    if mode is None:
        try:
            mode = infer_mode(tree)[0]
        except ConfigError as exc:
            return {"mode": "rl", "config": tree, "errors": error_list(str(exc))}
    tree = {k: v for k, v in tree.items() if k not in EXTRA_KEYS}
    if page_rewards and mode == "rl" and isinstance(tree.get("rewards"), list):
        ours = {(name, code_reward_ref("rewards", name, function)) for name, function in page_rewards}
        tree["rewards"] = [r for r in tree["rewards"]
                           if not (isinstance(r, dict) and (r.get("name"), r.get("function")) in ours)]
    cfg, errors = validate(mode, tree)
    unknown = {e["path"]: e["message"] for e in errors if e["message"].startswith(UNKNOWN_KEY)}
    if unknown:  # the form cannot show (or remove) a key the schema lacks: drop it, and say so (and what it may mean)
        tree = _without(tree, list(unknown))
        cfg, errors = validate(mode, tree)
        errors = [{"path": p, "message": "unknown key, left out of the imported config" + _hint(m)}
                  for p, m in unknown.items()] + errors
    return {"mode": mode, "config": normalized(cfg) if cfg is not None else tree, "errors": errors}


UNKNOWN_KEY = ("unknown field", "unknown section")  # config.suggest.unknown_key_message


def _hint(message: str) -> str:
    """The did-you-mean of an unknown-key message ('; did you mean weight?'), or nothing."""
    _, sep, hint = message.partition("; did you mean ")
    return f"; did you mean {hint}" if sep else ""


def _without(tree: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """A deep copy of `tree` without the dotted `paths` (list items by index: `rewards.0.fn`)."""
    out = json.loads(json.dumps(tree))
    for path in paths:
        *parents, last = path.split(".")
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) and part.isdigit() else node.get(part, {})
        if isinstance(node, dict):
            node.pop(last, None)
    return out


# ------------------------------------------------------------------------------------------ diagram


def _device(spec: str) -> str:
    if spec != "auto":
        return spec if spec != "cuda" else "cuda:0"
    try:
        import torch  # only to resolve "auto" as the trainer does

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        return "cpu"


def _model(role: str, active: bool, trainable: bool, device: str, why: str, name: str = "") -> dict[str, Any]:
    return {"role": role, "active": active, "trainable": trainable and active, "device": device if active else None,
            "why": why, "name": name}


def _rl_models(cfg: RLConfig, device: str) -> list[dict[str, Any]]:
    algo = cfg.algorithm
    lora = cfg.model.lora.rank > 0
    trains = f"LoRA adapters (rank {cfg.model.lora.rank})" if lora else "every weight"
    actor_why = f"the policy; trains {trains}"
    if cfg.engine.placement != "colocated":
        actor_why += f"; generation runs in a separate engine ({cfg.engine.placement})"
    critic_on = algo.advantage == "gae"
    critic_why = ("PPO: a value model for GAE advantages" if critic_on
                  else f"off: {algo.advantage} estimates advantages from the group's rewards, no value model")
    fns = [r for r in cfg.rewards if isinstance(r, RewardFunctionConfig)]
    models = [r for r in cfg.rewards if r.type == "model"]
    builtins = [r.name or r.builtin for r in cfg.rewards if r.type == "builtin"]
    names = ([cfg.data.task] if cfg.data.task else []) + [r.name or r.function for r in fns] + builtins
    reward_on = bool(names or models or cfg.env is not None)
    if models:
        reward_why, reward_device = f"reward model(s) on the policy's device; functions: {len(names)}", device
    elif cfg.env is not None:
        reward_why, reward_device = "the environment's episode returns", "process"
    else:
        reward_why, reward_device = "reward functions in forked workers (killed on timeout)", "process"
    if not reward_on:
        reward_why = "no reward configured: add a reward function, a reward model or a task"
    ref_on = algo.kl_coef > 0
    ref_why = (("the base weights with the adapters off (no extra copy)" if lora else "a frozen copy of the "
                "initial policy") + f" for the KL penalty (coef {algo.kl_coef:g})") if ref_on else \
        "off: algorithm.kl_coef is 0"
    return [
        _model("actor", True, True, device, actor_why, cfg.model.path),
        _model("critic", critic_on, True, device, critic_why, cfg.critic.path or cfg.model.path),
        _model("reward", reward_on, False, reward_device, reward_why,
               ", ".join(names + [r.name or r.path for r in models])),
        _model("reference", ref_on, False, device, ref_why, cfg.model.path),
    ]


def _offline_models(mode: str, cfg: BaseModel, device: str) -> list[dict[str, Any]]:
    path = cfg.model.path
    if mode == "reward_model":
        return [
            _model("actor", False, False, device, "off: reward modelling trains no policy"),
            _model("critic", False, False, device, "off: no value model"),
            _model("reward", True, True, device, "a one-label sequence classifier trained on chosen/rejected "
                   "pairs (Bradley-Terry)", path),
            _model("reference", False, False, device, "off: no reference"),
        ]
    ref_on = mode == "preference" and cfg.objective != "simpo"
    ref_why = "off" if mode == "sft" else ("off: SimPO needs no reference" if not ref_on else
                                          f"frozen copy of the start policy for {cfg.objective.upper()}")
    return [
        _model("actor", True, True, device, "the policy being fine-tuned", path),
        _model("critic", False, False, device, "off: no value model"),
        _model("reward", False, False, device, "off: the data (pairs / targets) is the signal"),
        _model("reference", ref_on, False, device, ref_why, path),
    ]


FLOWS = {
    "actor": [("actor", "reward", "completions")],
    "reward": [("reward", "actor", "rewards -> advantages")],
    "critic": [("critic", "actor", "values -> GAE advantages")],
    "reference": [("reference", "actor", "KL penalty")],
}


def diagram(mode: str, cfg: BaseModel) -> dict[str, Any]:
    """Which of actor / critic / reward / reference exist for this config, where, and why."""
    device = _device(cfg.model.device)
    if mode == "rl":
        models = _rl_models(cfg, device)
    else:
        models = _offline_models(mode, cfg, device)
    active = {m["role"] for m in models if m["active"]}
    flows = []
    if mode == "rl":
        for m in models:
            for src, dst, label in FLOWS[m["role"]] if m["active"] else []:
                if src in active and dst in active:
                    flows.append({"from": src, "to": dst, "label": label})
    elif mode == "preference" and "reference" in active:
        flows.append({"from": "reference", "to": "actor", "label": "reference log-probs"})
    return {"models": models, "flows": flows, "errors": []}


def diagram_for(mode: str, config: dict[str, Any]) -> dict[str, Any]:
    """The diagram of a possibly unfinished config: a missing model path or data source is filled with a
    placeholder (they do not change which models exist); other errors come back with no models."""
    tree = dict(config) if isinstance(config, dict) else {}
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    tree["model"] = {"path": "(model.path not set)", **model}
    if not isinstance(tree.get("data"), dict) or not ({"task", "path"} & tree["data"].keys()):
        tree["data"] = {**(tree.get("data") or {}), "path": "(data not set)"}
    cfg, errors = validate(mode, tree)
    if cfg is None:
        return {"models": [], "flows": [], "errors": errors}
    return diagram(mode, cfg)
