"""A vision-language GRPO run whose trainer is two FSDP2 ranks on Ray (cluster.backend: ray, the driver's engine):
the ranks load the policy as the driver does (its vision tower frozen), each trains its rows of the global batch
with their pictures, and the run ends with one process's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("PIL")


def digit_share(prompts, completions, **_):
    """Dense, so a random-init model gets non-zero advantages."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def _tree(model: str, out: Path) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "shapes", "num_train": 32, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 3},
        "algorithm": {"mini_batches": 2, "skip_zero_advantage": False},
        "training": {"learning_rate": 1e-2, "seed": 3, "micro_batch_tokens": 64},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }


def test_a_vlm_trains_on_ray_ranks_as_in_one_process(ray_cluster, tmp_path, tiny_vlm_path):
    import tokenmill
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray.run import train_on_ray

    torch.set_num_threads(1)
    tokenmill.train(_tree(tiny_vlm_path, tmp_path / "alone"), rewards=[digit_share])
    cfg = load_config(RLConfig, _tree(tiny_vlm_path, tmp_path / "ray") | {"cluster": {
        "backend": "ray", "nodes": 2, "cpus_per_node": 3, "trainer_ranks": 2, "max_restarts": 0,
        "call_timeout_s": 120}})
    result = train_on_ray(cfg, rewards=[digit_share], cluster=ray_cluster)
    assert result["restarts"] == 0
    want = load_file(str(tmp_path / "alone" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "ray" / "final" / "model.safetensors"))
    start = load_file(str(Path(tiny_vlm_path) / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-3  # it trained
    tower = [k for k in want if k.startswith("visual.")]
    assert tower and all(torch.equal(got[k], start[k]) for k in tower)  # the ranks held the tower too
    for name, tensor in want.items():  # two ranks sum each gradient in another order (see test_ray_train.py)
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=5e-5, msg=name)
