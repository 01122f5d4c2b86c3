"""`torchrun --nproc_per_node 2 -m tokenmill train` of a vision-language policy with `training.backend: fsdp2` on
the CPU (gloo): each rank samples its share of the prompts with their pictures and trains its rows of the
global batch with them; the run equals one process (torchrun, 1 rank) up to the order of float sums."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("PIL")

REWARD = '''
def digit_share(prompts, completions, **_):
    """Dense, so a random-init model gets non-zero advantages."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]
'''


def _config(folder: Path, model: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "rewards.py").write_text(REWARD)
    config = {
        "model": {"path": model},
        "data": {"task": "shapes", "num_train": 32, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 3},
        "rewards": [{"function": f"{folder / 'rewards.py'}:digit_share"}],
        "algorithm": {"mini_batches": 2, "skip_zero_advantage": False},
        "training": {"backend": "fsdp2", "learning_rate": 1e-2, "seed": 3},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": str(folder / "run"), "console": "none", "log_samples": 16},
        "checkpoint": {"every": 0, "save_final": True},
    }
    path = folder / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.mark.slow  # two torchrun jobs: about a minute on 2 cores (tests/unit/training/test_sharded_vision.py runs in CI)
def test_two_ranks_sample_and_train_a_vlm_as_one_process_does(tmp_path, tiny_vlm_path):
    out = {}
    for nproc in (1, 2):
        config = _config(tmp_path / f"ranks{nproc}", tiny_vlm_path)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(nproc), "-m", "tokenmill", "train", str(config)],
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        out[nproc] = tmp_path / f"ranks{nproc}" / "run"

    def samples(run: Path) -> list[tuple]:
        rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        return [(r["step"], r["completion"], r["reward"], round(r["advantage"], 9)) for r in rows]

    one, two = samples(out[1]), samples(out[2])
    assert len(one) == 3 * 16 and two == one  # each prompt's samples do not depend on which rank drew them
    assert len({c for _, c, _, _ in one}) > 8
    metrics = [json.loads(line) for line in (out[2] / "metrics.jsonl").read_text().splitlines()]
    for row in (r for r in metrics if "mismatch/max_abs" in r):  # the trainer ranks read the sampled pictures
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs"] <= 1e-5, row
    final1 = load_file(str(out[1] / "final" / "model.safetensors"))
    final2 = load_file(str(out[2] / "final" / "model.safetensors"))
    start = load_file(str(Path(tiny_vlm_path) / "model.safetensors"))
    assert max((final1[k] - start[k]).abs().max().item() for k in final1) > 1e-3  # it trained
    tower = [k for k in final1 if k.startswith("visual.")]
    assert tower and all(torch.equal(final2[k], start[k]) for k in tower)  # the frozen vision tower
    for name, tensor in final1.items():
        torch.testing.assert_close(final2[name], tensor, rtol=0, atol=1e-5, msg=name)
