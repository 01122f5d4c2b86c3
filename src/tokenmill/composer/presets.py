"""Starting configs per hardware target and mode. Each is a complete, valid config that fits its own device
by the memory estimate (tests check both).

The models follow the memory model in `tokenmill.estimate` (bytes per parameter of full fine-tuning vs LoRA):
a laptop trains a 0.5B model on CPU in fp32, one 24 GB GPU a 1.5B model with LoRA, one 80 GB GPU a 3B model
in full, and an 8xH100 node a 7B model with the policy on one GPU and generation in separate engine servers.
The token budget of one forward pass is then sized by the estimate's budget solver (`_fit`). The model ids
are Hugging Face hub names; any local folder of the same architecture works.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from tokenmill.composer.schema_ui import fixed_values
from tokenmill.config.modes import MODES
from tokenmill.estimate import estimate_for_config

# (id, title, description, device memory GiB, devices, model, lora rank, device, dtype, token budget, scale)
_TARGETS: list[dict[str, Any]] = [
    {"id": "laptop_cpu", "title": "Laptop (CPU)", "memory": 16, "devices": 1,
     "description": "Qwen2.5-0.5B on the CPU in fp32: slow but runs anywhere; short completions, small groups.",
     "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "device": "cpu", "dtype": "float32"},
     "tokens": 2048, "scale": 1},
    {"id": "gpu_24gb", "title": "One 24 GB GPU", "memory": 24, "devices": 1,
     "description": "Qwen2.5-1.5B with LoRA (rank 32) in bf16: full fine-tuning of 1.5B needs ~24 GB of model "
                    "states alone.",
     "model": {"path": "Qwen/Qwen2.5-1.5B-Instruct", "device": "cuda:0", "dtype": "bfloat16",
               "lora": {"rank": 32, "alpha": 64.0}},
     "tokens": 8192, "scale": 2},
    {"id": "gpu_80gb", "title": "One 80 GB GPU", "memory": 80, "devices": 1,
     "description": "Qwen2.5-3B, every weight trained in bf16 with fp32 AdamW states (~49 GB) and room for "
                    "activations.",
     "model": {"path": "Qwen/Qwen2.5-3B-Instruct", "device": "cuda:0", "dtype": "bfloat16"},
     "tokens": 16384, "scale": 4},
    # tokenmill trains in one process on one device: the estimate is of the trainer's GPU
    {"id": "node_8xh100", "title": "8xH100 node", "memory": 80, "devices": 1,
     "description": "Qwen2.5-7B with LoRA (rank 64) trained on one GPU while 7 engine servers generate on the "
                    "others (RL: engine.placement process, one step off-policy); the memory shown is the "
                    "trainer's GPU.",
     "model": {"path": "Qwen/Qwen2.5-7B-Instruct", "device": "cuda:0", "dtype": "bfloat16",
               "lora": {"rank": 64, "alpha": 128.0}},
     "tokens": 16384, "scale": 8, "servers": 7},
]


def _rl(t: dict[str, Any]) -> dict[str, Any]:
    s = t["scale"]
    cfg: dict[str, Any] = {
        "data": {"task": "countdown"},
        "generation": {"group_size": 4 if s == 1 else 8, "max_tokens": 64 if s == 1 else 256 * min(s, 4),
                       "temperature": 1.0},
        "algorithm": {"advantage": "grpo", "kl_coef": 0.0},
        "training": {"learning_rate": 1e-6 if "lora" not in t["model"] else 1e-5,
                     "micro_batch_tokens": t["tokens"]},
        "controller": {"steps": 200, "prompts_per_step": 4 * s, "eval_every": 50},
        "tracking": {"console": "plain"},
        "checkpoint": {"every": 50},
    }
    if t.get("servers"):
        cfg["engine"] = {"placement": "process", "num_servers": t["servers"]}
        cfg["controller"]["max_staleness"] = 1
    return cfg


def _sft(t: dict[str, Any]) -> dict[str, Any]:
    return {"data": {"task": "addition"}, "steps": 300, "batch_size": 8 * t["scale"],
            "micro_batch_tokens": t["tokens"], "learning_rate": 2e-5 if "lora" not in t["model"] else 2e-4,
            "packing": t["scale"] > 1}


def _preference(t: dict[str, Any]) -> dict[str, Any]:
    return {"data": {"task": "addition"}, "objective": "dpo", "beta": 0.1, "steps": 200,
            "batch_size": 4 * t["scale"], "learning_rate": 5e-7 if "lora" not in t["model"] else 5e-6}


def _reward_model(t: dict[str, Any]) -> dict[str, Any]:
    return {"data": {"task": "addition"}, "steps": 200, "batch_size": 8 * t["scale"], "learning_rate": 1e-5}


_BY_MODE = {"rl": _rl, "sft": _sft, "preference": _preference, "reward_model": _reward_model}


def _fit(mode: str, config: dict[str, Any], memory_gib: float) -> dict[str, Any]:
    """The config with its per-forward token budget set by the memory estimate's budget solver, so that the
    preset, applied as is, fits its own device: RL and SFT get the solver's `micro_batch_tokens`; preference
    and reward modelling (a step's pairs in one forward) the batch size it allows."""
    result = estimate_for_config({**config, "mode": mode}, device_memory_gib=memory_gib)
    budget = result["budget"]
    if result["devices"][0]["fits"] or not budget["fits"]:
        return config
    if mode == "rl":
        config["training"]["micro_batch_tokens"] = budget["suggested_micro_batch_tokens"]
    elif mode == "sft":
        config["micro_batch_tokens"] = budget["suggested_micro_batch_tokens"]
    else:
        config["batch_size"] = max(1, budget["micro_batch"] // 2)
    return config


MODELS_DIR_ENV = "TOKENMILL_MODELS_DIR"


def local_model(hub_id: str, models_dir: str | Path | None) -> Path | None:
    """The folder `models_dir/<name>` for hub id `org/<name>` when it holds a model (a config.json)."""
    if not models_dir:
        return None
    folder = Path(models_dir).expanduser() / hub_id.rsplit("/", 1)[-1]
    return folder.resolve() if (folder / "config.json").is_file() else None


def presets(mode: str = "rl", models_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The body of GET /api/presets?mode=...; a preset whose model is found in `models_dir` (default:
    $TOKENMILL_MODELS_DIR) points at that folder instead of the Hub, and says so (`model_source`)."""
    if mode not in MODES:
        raise ValueError(f"mode: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    models_dir = models_dir if models_dir is not None else os.environ.get(MODELS_DIR_ENV)
    out = []
    for t in _TARGETS:
        model = copy.deepcopy(t["model"])
        folder = local_model(model["path"], models_dir)
        source = (f"local folder {folder}" if folder else
                  f"{model['path']} from the Hugging Face Hub (downloaded on first use; offline, set "
                  f"{MODELS_DIR_ENV} to a folder holding {model['path'].rsplit('/', 1)[-1]}/)")
        if folder:
            model["path"] = str(folder)
        config = _fit(mode, {"model": model, **_BY_MODE[mode](t), **fixed_values(mode)}, t["memory"])
        out.append({"id": t["id"], "title": t["title"], "description": t["description"], "mode": mode,
                    "config": config, "device_memory_gib": t["memory"], "num_devices": t["devices"],
                    "model_source": source, "local": folder is not None})
    return out
