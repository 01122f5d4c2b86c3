"""Kill-and-resume equals an uninterrupted run: N steps + stop + resume N steps == 2N steps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import tokenmill
from tokenmill.testing import build_tiny_model


def digit_share(prompts, completions, **_):
    """A dense reward (share of digits), so a random-init model gets non-zero advantages."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


PPO = {"advantage": "gae", "kl_coef": 0.05, "kl_in_reward": True}


def _config(model: str, out: str, algorithm: dict | None = None, **controller) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 500, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"ppo_epochs": 2, "mini_batches": 2, **(algorithm or {})},
        "training": {"learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "seed": 3},
        "controller": {"steps": 6, "prompts_per_step": 4, **controller},
        "tracking": {"output_dir": out, "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }


def _final_weights(out) -> dict[str, torch.Tensor]:
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    return load_file(str(ckpts[-1] / "model.safetensors"))


def _critic_weights(out) -> dict[str, torch.Tensor]:
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    return torch.load(ckpts[-1] / "trainer.pt", weights_only=True)["critic"]["weights"]


@pytest.mark.parametrize("algorithm", [None, PPO], ids=["grpo", "ppo_critic"])
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    full, split = tmp_path / "full", tmp_path / "split"
    tokenmill.train(_config(model, str(full), algorithm), rewards=[digit_share])
    first = tokenmill.train(_config(model, str(split), algorithm, max_steps_per_run=3), rewards=[digit_share])
    assert first["resumed_from"] == 0
    assert [p.name for p in (split / "checkpoints").glob("step_*")] == ["step_00000003"]
    second = tokenmill.train(_config(model, str(split), algorithm), rewards=[digit_share],
                             checkpoint__resume=True)
    assert second["resumed_from"] == 3

    a, b = _final_weights(full), _final_weights(split)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    if algorithm is not None:  # PPO: the critic's weights resume exactly too, and they moved
        critics = [_critic_weights(out) for out in (full, split)]
        assert critics[0].keys() == critics[1].keys()
        assert all(torch.equal(critics[0][k], critics[1][k]) for k in critics[0])
        assert float(critics[0]["score.weight"].abs().sum()) > 0  # the value head started at zero
    # the weights really moved, so equality is not trivial
    init = load_file(f"{model}/model.safetensors")
    assert any(not torch.equal(init[k], a[k]) for k in a.keys() & init.keys())
    # the metrics of the resumed steps equal the uninterrupted ones (same samples, same rewards)
    def step_rewards(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}

    assert step_rewards(full) == step_rewards(split)


def test_resume_without_checkpoint_starts_fresh_and_finished_run_trains_nothing(tmp_path):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "run"
    cfg = _config(model, str(out), steps=2)
    first = tokenmill.train(cfg, checkpoint__resume=True)
    assert first["resumed_from"] == 0
    again = tokenmill.train(cfg, checkpoint__resume=True)
    assert again["resumed_from"] == 2
    assert again["last_metrics"] == {}


def test_resume_writes_the_final_export_a_killed_run_still_owed(tmp_path):
    """Killed after the last checkpoint but before `final/` existed: the resumed run exports (and evaluates)
    instead of reporting "nothing left to train"."""
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "run"
    cfg = _config(model, str(out), steps=2)
    cfg["data"]["num_eval"] = 4
    first = tokenmill.train(cfg, rewards=[digit_share])
    weights = load_file(str(out / "final" / "model.safetensors"))
    # the state a kill -9 between the last checkpoint and the export leaves: step 2 saved, no final/
    shutil.rmtree(out / "final")
    again = tokenmill.train(cfg, rewards=[digit_share], checkpoint__resume=True)
    assert again["resumed_from"] == 2 and again["eval_after"] == first["eval_after"]
    exported = load_file(str(out / "final" / "model.safetensors"))
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".lock"]  # no temporary export left
    # with final/ in place a further resume has nothing left to do: no export, no evaluation
    third = tokenmill.train(cfg, rewards=[digit_share], checkpoint__resume=True)
    assert third["resumed_from"] == 2 and "eval_after" not in third and third["last_metrics"] == {}


def test_cli_resume_skips_a_damaged_checkpoint_and_refuses_when_none_is_usable(tmp_path, capsys, caplog):
    from tokenmill.cli import main

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "run"
    cfg = _config(model, str(out), steps=3, max_steps_per_run=2)
    cfg["checkpoint"] |= {"every": 1, "keep_last": 3}
    tokenmill.train(cfg)  # stops after step 2: checkpoints 1 and 2
    cfg["controller"]["max_steps_per_run"] = 0
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))
    checkpoints = out / "checkpoints"
    for step in (1, 2):  # a damaged trainer state in both: nothing to resume from
        state = checkpoints / f"step_{step:08d}" / "trainer.pt"
        state.write_bytes(state.read_bytes()[:-8])
    assert main(["train", str(path), "--checkpoint.resume", "true"]) == 2
    err = capsys.readouterr().err
    err = err[err.index("tokenmill: "):]  # after the libraries' progress bars
    assert err.startswith(f"tokenmill: no usable checkpoint in {checkpoints}; every one found is damaged:")
    assert "step_00000002: trainer.pt has" in err and "Traceback" not in err
    # step 1 repaired (saved again by a short run), step 2 still damaged: resume from 1 with a warning
    shutil.rmtree(checkpoints / "step_00000001")
    again = dict(cfg, controller={**cfg["controller"], "max_steps_per_run": 1})
    tokenmill.train(again, checkpoint__resume=False, checkpoint__keep_last=3)
    assert main(["train", str(path), "--checkpoint.resume", "true"]) == 0
    assert any("step_00000002 is unusable: trainer.pt has" in r.getMessage() for r in caplog.records)
    assert (out / "final" / "config.json").is_file() and (checkpoints / ".corrupt-step_00000002").is_dir()


def test_resume_reads_an_older_engine_key_and_refuses_a_checkpoint_of_another_kind_of_run(tmp_path, capsys):
    """A trainer state that keeps the sampling RNG under the older `engine_rng` key resumes like the current one;
    a GRPO checkpoint resumed by a PPO config (no critic in it) is one message naming the field, exit 2."""
    from tokenmill.checkpoint.atomic import file_sha256
    from tokenmill.cli import main

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "run"
    cfg = _config(model, str(out), steps=3, max_steps_per_run=2)
    cfg["checkpoint"]["every"] = 2
    tokenmill.train(cfg, rewards=[digit_share])  # step 2 saved, 1 step left
    folder = out / "checkpoints" / "step_00000002"
    state = torch.load(folder / "trainer.pt", weights_only=False)
    state["engine_rng"] = state.pop("engine")["rng"]
    torch.save(state, folder / "trainer.pt")
    meta = json.loads((folder / "meta.json").read_text())
    state_file = folder / "trainer.pt"
    meta["files"]["trainer.pt"] = {"bytes": state_file.stat().st_size, "sha256": file_sha256(state_file)}
    (folder / "meta.json").write_text(json.dumps(meta))
    ppo = dict(cfg, algorithm={**cfg["algorithm"], **PPO}, controller={**cfg["controller"], "max_steps_per_run": 0})
    path = tmp_path / "ppo.yaml"
    path.write_text(json.dumps(ppo))
    assert main(["train", str(path), "--checkpoint.resume", "true"]) == 2  # another advantage: refused as such
    err = capsys.readouterr().err
    assert f"checkpoint.resume: {folder} was written by a different run" in err
    assert "algorithm.advantage: 'grpo' -> 'gae'" in err and "Traceback" not in err
    # forced on (checkpoint.resume_anyway), the state still lacks the critic the PPO run needs
    assert main(["train", str(path), "--checkpoint.resume", "true", "--checkpoint.resume_anyway", "true"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.resume: {folder} lacks critic" in err and "Traceback" not in err
    cfg["controller"]["max_steps_per_run"] = 0
    again = tokenmill.train(cfg, rewards=[digit_share], checkpoint__resume=True)
    assert again["resumed_from"] == 2 and again["last_metrics"]


def test_resume_refuses_another_model_group_size_or_advantage_and_records_safe_changes(tmp_path, capsys):
    """What the checkpoint means (model, its shapes, group size, advantage) must match: refused before any weight
    is loaded, with a message naming the fields (a model of another shape is not called damaged). The run's length
    may change: said, and recorded as a `resume_changes` event."""
    from tokenmill.checkpoint.fingerprint import ResumeMismatch
    from tokenmill.cli import main

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    same_shape = build_tiny_model(tmp_path / "m2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  seed=1)
    wider = build_tiny_model(tmp_path / "m3", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    out = tmp_path / "run"
    cfg = _config(model, str(out), steps=2, max_steps_per_run=1)
    tokenmill.train(cfg)  # step 1 saved
    folder = out / "checkpoints" / "step_00000001"
    cfg["controller"]["max_steps_per_run"] = 0
    with pytest.raises(ResumeMismatch) as refused:
        tokenmill.train(dict(cfg, model={"path": same_shape}, generation={"group_size": 2, "max_tokens": 4}),
                        checkpoint__resume=True)
    message = str(refused.value)
    assert message.startswith(f"checkpoint.resume: {folder} was written by a different run")
    assert "generation.group_size: 4 -> 2" in message and f"model.path: {os.path.realpath(model)!r} -> {os.path.realpath(same_shape)!r}" in message
    assert "checkpoint.resume_anyway: true" in message
    path = tmp_path / "wider.yaml"
    path.write_text(json.dumps(dict(cfg, model={"path": wider})))
    assert main(["train", str(path), "--checkpoint.resume", "true", "--checkpoint.resume_anyway", "true"]) == 2
    err = capsys.readouterr().err
    err = err[err.index("tokenmill: "):]
    assert "model.parameters: '" in err and "cannot be loaded into this model" in err
    assert "damaged" not in err and "Traceback" not in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]  # nothing moved aside
    # a longer run is a safe change: resumed, said and recorded
    again = tokenmill.train(cfg, checkpoint__resume=True, controller__steps=3)
    assert again["resumed_from"] == 1
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    changes = [e for e in events if e["event"] == "resume_changes"]
    assert len(changes) == 1 and changes[0]["overridden"] == []
    assert changes[0]["settings"] == ["controller.max_steps_per_run: 1 -> 0", "controller.steps: 2 -> 3"]
