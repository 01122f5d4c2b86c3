"""An environment defines success (`StepResult.info["solved"]`) and its info numbers become metrics."""

from __future__ import annotations

import math

from tokenmill.envs import StepResult
from tokenmill.envs.metrics import episode_metrics, succeeded
from tokenmill.types import Sample, StopReason


class SolvedAtACost:
    """Every answer solves the task, at a cost per turn: the return is 0.5, below the 1.0 a return-based
    accuracy would ask for."""

    def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, message):
        return StepResult([], reward=0.5, done=True, info={"solved": True, "cost": 0.5, "note": "text is skipped"})


def _episode(reward: float, info: dict, turns: int = 1) -> Sample:
    return Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, 0.0), prompt_len=1, prompt="p", completion="c",
                  stop_reason=StopReason.STOP, reward=reward, row={"turns": turns, "info": info})


def test_success_is_the_environments_word_where_it_gives_one():
    assert succeeded(_episode(0.5, {"solved": True}))
    assert not succeeded(_episode(1.0, {"solved": False}))  # a return of 1.0 without solving is not success
    assert succeeded(_episode(1.0, {}))  # no word from the environment: the return decides
    assert not succeeded(_episode(math.nan, {"solved": True}))  # a failed episode is not a success
    # a dataset row that is not an episode is judged by its reward
    row = Sample(tokens=(1,), loss_mask=(1,), logprobs=(0.0,), prompt_len=0, prompt="p", completion="c",
                 stop_reason=StopReason.STOP, reward=1.0, row={"info": {"solved": False}})
    assert succeeded(row)


def test_info_numbers_are_averaged_over_the_episodes_that_report_them():
    samples = [_episode(1.0, {"solved": True, "tool_calls": 2, "turn_limit": True}, turns=3),
               _episode(0.0, {"solved": False, "tool_calls": 4, "name": "x"}, turns=1),
               _episode(0.0, {"score": 0.25}, turns=2)]
    assert episode_metrics(samples) == {
        "env/turns": 2.0, "env/solved": 1 / 3, "env/turn_limit": 1 / 3, "env/token_limit": 0.0,
        "env/tool_calls": 3.0, "env/score": 0.25,
    }
    assert episode_metrics([Sample(tokens=(1,), loss_mask=(1,), logprobs=(0.0,), prompt_len=0, prompt="p",
                                   completion="c", stop_reason=StopReason.STOP, row={"prompt": "p"})]) == {}


def test_a_run_reports_the_environments_success_and_info(tmp_path, tiny_model_path):
    import tokenmill

    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"path": "unused.jsonl", "num_eval": 0},
        "env": {"name": f"{__name__}:SolvedAtACost", "max_turns": 2, "max_episode_tokens": 64},
        "generation": {"group_size": 2, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    metrics = tokenmill.train(cfg, dataset=[{"prompt": "a"}, {"prompt": "b"}])["last_metrics"]
    assert metrics["reward/mean"] == 0.5
    assert metrics["accuracy"] == 1.0  # was 0.0: the return 0.5 is below 1.0, though every episode was solved
    assert (metrics["env/solved"], metrics["env/turns"], metrics["env/cost"]) == (1.0, 1.0, 0.5)
    assert "env/note" not in metrics


def always_formatted(completions, **kwargs):
    return [1.0 for _ in completions]


def test_a_tasks_verifier_defines_training_accuracy_not_the_total(tmp_path, tiny_model_path):
    import json

    import tokenmill

    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"task": "addition", "num_train": 16, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 4},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none", "log_samples": 16},
        "checkpoint": {"every": 0, "save_final": False},
    }
    metrics = tokenmill.train(cfg, rewards=[always_formatted])["last_metrics"]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and all(s["reward"] >= 1.0 for s in samples)  # every total reaches 1.0 ...
    solved = sum(s["rewards"]["addition"] == 1.0 for s in samples) / 16
    assert metrics["accuracy"] == solved and solved < 1.0  # ... but only the verifier's 1.0 is a success


def test_an_info_key_named_turns_never_overwrites_the_loops_turn_count():
    # the documented hot/cold environment reports its own "turns" only when solved: 2 here, while the loop
    # counted 2 and 6 policy turns (one episode cut at the limit)
    samples = [_episode(1.0, {"solved": True, "turns": 2}, turns=2), _episode(0.0, {"turn_limit": True}, turns=6)]
    metrics = episode_metrics(samples, prefix="eval/env/")
    assert metrics["eval/env/turns"] == 4.0  # the loop's policy turns, over every episode
    assert metrics["eval/env/info/turns"] == 2.0  # the environment's own number, under its own name
    assert metrics["eval/env/solved"] == 0.5 and metrics["eval/env/turn_limit"] == 0.5
