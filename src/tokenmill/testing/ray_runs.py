"""The same tiny GRPO run twice, for the Ray tests: once in one process sampling from a local `tokenmill serve`
(the reference), once with its trainer on Ray (`controller.ray.run.train_on_ray`), and the final weights of
both, so that a test asserts that a placement (broadcast, colocation, LoRA on the ranks) changes where things
run, not what is learnt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tokenmill.testing.rewards import digit_share


def tiny_grpo_tree(model: str, **model_extra: Any) -> dict[str, Any]:
    """Three steps of 4 prompts x 4 samples of addition, a final checkpoint and no others; `model_extra` joins
    the model section (e.g. `lora={...}`)."""
    return {
        "model": {"path": model, **model_extra},
        "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"mini_batches": 2},
        "training": {"learning_rate": 1e-3, "seed": 3, "micro_batch_tokens": 64},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "checkpoint": {"every": 0, "save_final": True},
    }


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The weights of the run folder `out`'s last checkpoint."""
    return load_file(str(max((out / "checkpoints").glob("step_*")) / "model.safetensors"))


def serve_then_ray(cluster, tmp_path: Path, tree: dict[str, Any], **ray: Any) -> tuple[dict, dict]:
    """Run `tree` in one process with a local server (tmp_path/server), then on `cluster` with two trainer ranks
    and one engine replica over two nodes, `ray` joining the cluster section (tmp_path/ray); the final weights
    of the first and of the second."""
    import tokenmill
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray.run import train_on_ray

    tokenmill.train(tree | {"tracking": {"output_dir": str(tmp_path / "server"), "console": "none"},
                            "engine": {"placement": "process", "threads": 1}}, rewards=[digit_share])
    cfg = load_config(RLConfig, tree | {
        "tracking": {"output_dir": str(tmp_path / "ray"), "console": "none"},
        "cluster": {"backend": "ray", "nodes": 2, "cpus_per_node": 3, "trainer_ranks": 2, "engine_replicas": 1,
                    "max_restarts": 0, "call_timeout_s": 120, **ray}})
    train_on_ray(cfg, rewards=[digit_share], cluster=cluster)
    return final_weights(tmp_path / "server"), final_weights(tmp_path / "ray")
