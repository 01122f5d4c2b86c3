"""Held-out evaluation of any dataset: `data.num_eval` rows split off a `data.path` dataset (or one passed to
`tokenmill.train`), or `data.eval_path`, scored with the run's rewards or environment."""

from __future__ import annotations

import json
import statistics

import pytest

from tokenmill.config.schema import RLConfig
from tokenmill.data.prompts import split_held_out
from tokenmill.envs import StepResult
from tokenmill.types import ConfigError

ROWS = [{"prompt": f"q{i}", "score": float(i)} for i in range(8)]


def column_score(completions, score, **kwargs):
    return [float(s) for s in score]


def test_split_is_seeded_disjoint_and_keeps_order():
    train, held = split_held_out(ROWS, 3, seed=5)
    assert len(train) == 5 and len(held) == 3
    assert sorted(r["score"] for r in train + held) == [r["score"] for r in ROWS]  # every row once
    assert [r["score"] for r in held] == sorted(r["score"] for r in held)  # dataset order kept
    assert split_held_out(ROWS, 3, seed=5) == (train, held)  # same seed, same split
    assert split_held_out(ROWS, 3, seed=6)[1] != held
    assert split_held_out(ROWS, 0) == (ROWS, None)
    with pytest.raises(ConfigError, match="data.num_eval: 8 held-out rows leave none of the dataset's 8"):
        split_held_out(ROWS, 8)


def test_a_datasets_dataset_splits_the_same_way():
    from datasets import Dataset

    train, held = split_held_out(Dataset.from_list(ROWS), 3, seed=5)
    assert held.to_list() == split_held_out(ROWS, 3, seed=5)[1] and len(train) == 5


def _cfg(tmp_path, **data):
    return {
        "model": {"path": "unused", "device": "cpu"},
        "data": {"path": str(tmp_path / "rows.jsonl"), **data},
        "rewards": [{"function": f"{__name__}:column_score", "isolation": "thread"}],
        "generation": {"group_size": 2, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }


def test_num_eval_defaults_to_none_for_a_dataset_and_1000_for_a_task(tmp_path):
    assert RLConfig.model_validate(_cfg(tmp_path)).data.held_out_rows == 0
    assert RLConfig.model_validate(_cfg(tmp_path, num_eval=3)).data.held_out_rows == 3
    task = _cfg(tmp_path)
    task["data"] = {"task": "addition"}
    assert RLConfig.model_validate(task).data.held_out_rows == 1000
    with pytest.raises(ValueError, match="data.eval_path is for a dataset given by data.path"):
        RLConfig.model_validate(task | {"data": {"task": "addition", "eval_path": "x.jsonl"}})
    with pytest.raises(ValueError, match="set one of data.eval_path or data.num_eval"):
        RLConfig.model_validate(_cfg(tmp_path, num_eval=2, eval_path="x.jsonl"))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_num_eval_splits_a_dataset_and_evaluates_it_with_the_runs_rewards(tmp_path, tiny_model_path):
    import tokenmill

    _write(tmp_path / "rows.jsonl", ROWS)
    cfg = _cfg(tmp_path, num_eval=3)
    cfg["model"]["path"] = tiny_model_path
    result = tokenmill.train(cfg)
    held = split_held_out(ROWS, 3, seed=0)[1]  # training.seed 0
    expected = statistics.fmean(r["score"] for r in held)
    for key in ("eval_before", "eval_after"):
        assert result[key]["eval/rows"] == 3
        assert result[key]["eval/reward/column_score"] == pytest.approx(expected)
    # the held-out prompts never reach training
    trained = {json.loads(x)["prompt"] for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()}
    assert trained and not trained & {r["prompt"] for r in held}


def test_eval_path_is_evaluated_and_checked_by_validate(tmp_path, tiny_model_path):
    import tokenmill
    from tokenmill.config.preflight import check_run

    _write(tmp_path / "rows.jsonl", ROWS)
    _write(tmp_path / "held.jsonl", [{"prompt": "h1", "score": 10.0}, {"prompt": "h2", "score": 30.0}])
    cfg = _cfg(tmp_path, eval_path=str(tmp_path / "held.jsonl"))
    cfg["model"]["path"] = tiny_model_path
    result = tokenmill.train(cfg)
    assert result["eval_after"]["eval/rows"] == 2 and result["eval_after"]["eval/reward/column_score"] == 20.0
    _write(tmp_path / "bad.jsonl", [{"prompt": "h1"}])
    bad = RLConfig.model_validate(cfg | {"data": cfg["data"] | {"eval_path": str(tmp_path / "bad.jsonl")}})
    with pytest.raises(ConfigError, match=r"data.eval_path: rewards.0.function: column_score\(\) needs the "
                                          r"dataset column\(s\) 'score'"):
        check_run(bad)


class Solves:
    def reset(self, task):
        return task["prompt"]

    def step(self, message):
        return StepResult([], reward=0.25, done=True, info={"solved": True, "cost": 0.75})


def test_an_environment_run_evaluates_the_rows_split_off_its_dataset(tmp_path, tiny_model_path):
    import tokenmill

    _write(tmp_path / "rows.jsonl", ROWS)
    cfg = _cfg(tmp_path, num_eval=2)
    cfg["model"]["path"] = tiny_model_path
    cfg["rewards"] = []
    cfg["env"] = {"name": f"{__name__}:Solves", "max_turns": 1, "max_episode_tokens": 64}
    after = tokenmill.train(cfg)["eval_after"]
    assert after["eval/rows"] == 2 and after["eval/reward_mean"] == 0.25
    assert after["eval/accuracy"] == 1.0 and after["eval/env/cost"] == 0.75  # the env's word, not return >= 1
