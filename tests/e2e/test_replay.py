"""Record and replay: a run's dumped rollouts, replayed with the same seed and no engine, give the same weights
bit for bit; `tokenmill train --rollout-only` generates, scores and dumps without moving a weight."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

import tokenmill
from tokenmill.cli import main
from tokenmill.rollout.record import read_dump
from tokenmill.testing import build_tiny_model


def digit_share(prompts, completions, **_):
    """A dense reward, so that a random-init model gets non-zero advantages."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _config(model: str, out: str, **record) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"ppo_epochs": 2, "mini_batches": 2},
        "training": {"learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1, "seed": 5},
        "controller": {"steps": 5, "prompts_per_step": 4},
        "tracking": {"output_dir": out, "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
        "record": record,
    }


def _final(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def test_replay_of_a_dump_gives_identical_weights(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    live, replay = tmp_path / "live", tmp_path / "replay"
    tokenmill.train(_config(model, str(live), rollouts=True, every=2), rewards=[digit_share])
    dump = live / "rollouts"
    assert [p.name for p in sorted(dump.glob("*.parquet"))] == [
        "steps_00000001-00000002.parquet", "steps_00000003-00000004.parquet", "steps_00000005-00000005.parquet"]
    steps = read_dump(dump)
    assert sorted(steps) == [1, 2, 3, 4, 5] and all(len(g) == 4 for g in steps.values())

    from tokenmill.engines.local import hf

    def no_engine(*args, **kwargs):
        raise AssertionError("a replay built an engine")

    monkeypatch.setattr(hf.HFEngine, "__init__", no_engine)
    tokenmill.train(_config(model, str(replay), replay=str(dump)), rewards=[digit_share])
    a, b = _final(live), _final(replay)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    init = load_file(f"{model}/model.safetensors")
    assert any(not torch.equal(init[k], a[k]) for k in a.keys() & init.keys())  # the weights did move

    def losses(out):  # rewards, losses and gradient norms of every step
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k == "reward/mean" or "loss" in k or "grad_norm" in k}
                for r in rows if "reward/mean" in r]

    got = losses(live)
    assert len(got) == 5 and all(len(r) >= 3 for r in got)
    assert got == losses(replay)


def test_cli_rollout_only_dumps_and_trains_nothing(tmp_path, capsys):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "ro"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({k: v for k, v in _config(model, str(out)).items() if k != "record"}))
    assert main(["train", str(cfg), "--rollout-only", "--controller.steps", "3"]) == 0
    steps = read_dump(out / "rollouts")
    assert sorted(steps) == [1, 2, 3]
    rewards = [s.reward for g in steps[2] for s in g.samples]
    assert len(rewards) == 16 and all(0.0 <= r <= 1.0 for r in rewards)  # scored by the addition verifier
    init = load_file(f"{model}/model.safetensors")
    final = _final(out)
    assert all(torch.equal(init[k], final[k]) for k in final.keys() & init.keys())
    assert main(["train", str(cfg), "--replay", str(tmp_path / "nothing")]) == 1
    assert "no rollout shards" in capsys.readouterr().err


def test_train_help_names_replay_and_rollout_only(capsys):
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--replay DIR: train from the rollouts recorded in DIR" in help_text
    assert "--rollout-only: generate and score, record, never train" in help_text


def test_replay_refuses_a_gap_a_changed_setting_and_a_truncated_shard(tmp_path, capsys):
    """A real recording: with a shard gone from the middle, with another group size / prompts per step / max
    tokens / model than it was recorded with, or with a truncated shard, the replay ends with status 1 and
    one line naming the steps, the fields or the file; the complete recording replays."""
    import shutil

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({k: v for k, v in _config(model, str(tmp_path / "live")).items() if k != "record"}))
    assert main(["train", str(cfg), "--rollout-only", "--record.every", "1", "--controller.steps", "3"]) == 0
    dump = tmp_path / "live" / "rollouts"
    assert json.loads((dump / "recording.json").read_text())["fingerprint"]["generation.group_size"] == 4

    def replay(folder, *extra) -> str:
        capsys.readouterr()
        code = main(["train", str(cfg), "--replay", str(folder), "--tracking.output_dir",
                     str(tmp_path / f"r{len(list(tmp_path.iterdir()))}"), "--controller.steps", "3", *extra])
        err = capsys.readouterr().err.strip()
        return f"{code}: {err.splitlines()[-1] if err else ''}"

    gap = tmp_path / "gap"
    shutil.copytree(dump, gap)
    (gap / "steps_00000002-00000002.parquet").unlink()
    assert replay(gap).startswith("1: ") and "misses steps 2 (no shard holds them)" in replay(gap)
    for flag, value, field in (("--generation.group_size", "8", "generation.group_size: recorded 4, now 8"),
                               ("--controller.prompts_per_step", "2", "controller.prompts_per_step: recorded 4"),
                               ("--generation.max_tokens", "5", "generation.max_tokens: recorded 4, now 5"),
                               ("--model.path", str(tmp_path / "other"), "model.path: recorded")):
        if flag == "--model.path":
            build_tiny_model(tmp_path / "other", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
        said = replay(dump, flag, value)
        assert said.startswith("1: ") and "recorded with other settings" in said and field in said, said
    assert "model.config.hidden_size: recorded 32, now 16" in said
    cut = tmp_path / "cut"
    shutil.copytree(dump, cut)
    shard = cut / "steps_00000003-00000003.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    said = replay(cut)
    assert said.startswith("1: ") and "steps_00000003-00000003.parquet' (steps 3) is unreadable" in said, said
    assert replay(dump).startswith("0: ")
