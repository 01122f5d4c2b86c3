"""`tokenmill train` with `training.backend: fsdp2` and a LoRA policy on 2 CPU ranks (the group joined through a
file, as torchrun's would be): the KL reference is the sharded policy with its adapters off, so the KL is 0 at
the first step (the adapters start as a no-op) and not after, and the export has the trained adapters merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")


def digit_share(prompts, completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _worker(rank: int, world: int, tmp: str, model: str) -> None:
    import torch.distributed as dist

    import tokenmill
    from tokenmill.training.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=120)
    out = Path(tmp) / "run"
    cfg = {
        "model": {"path": model, "lora": {"rank": 4, "alpha": 8}},
        "data": {"task": "addition", "num_train": 64, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"kl_coef": 0.5},
        "training": {"backend": "fsdp2", "learning_rate": 5e-2, "seed": 3, "micro_batch_tokens": 64},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"save_final": True},
    }
    tokenmill.train(cfg, rewards=[digit_share])
    dist.destroy_process_group()


@pytest.mark.slow  # ~30 s: two spawned ranks import torch and transformers, then a 3-step run
def test_lora_policy_trains_on_two_fsdp2_ranks_against_its_adapters_off(tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from tokenmill.testing import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    mp.spawn(_worker, args=(2, str(tmp_path), model), nprocs=2, join=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl"] for r in rows if "kl" in r]
    assert len(kl) == 3
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy with its (no-op) adapters off
    assert kl[-1] > 1e-5  # the adapters trained, and the reference did not follow them
    base = load_file(str(next(Path(model).glob("*.safetensors"))))
    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))  # adapters merged in
    assert sorted(final) == sorted(base)
    assert max((final[n] - base[n]).abs().max().item() for n in base) > 1e-4
