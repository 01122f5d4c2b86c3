"""`tokenmill eval`: a config's held-out evaluation from the command line, as a run of it evaluates (the same
numbers for the same weights and rows, sampled ones included); a NaN result is an error with its reason, never
a number printed with exit 0."""

from __future__ import annotations

import json
import math

import yaml

from tokenmill.cli import main
from tokenmill.envs.base import StepResult

HOT_COLD = '''
from tokenmill.envs.base import StepResult


class HotCold:
    """The documented hot/cold game in 1..3: its own "turns" in info when solved, as in docs/environments.md."""

    def reset(self, task):
        self.secret, self.turns = int(task["secret"]), 0
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, message):
        self.turns += 1
        text = (message.get("content") or "").strip()
        if text == str(self.secret):
            return StepResult([], 1.0, True, {"solved": True, "turns": self.turns})
        return StepResult([{"role": "user", "content": "no"}], 0.0, self.turns >= 3)
'''


def nan_reward(completions, **kwargs):
    return [math.nan for _ in completions]


def _config(tmp_path, **extra) -> str:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": "1-3", "secret": s}) + "\n"
                                                 for s in (1, 2, 3, 1)))
    cfg = {"data": {"path": str(tmp_path / "rows.jsonl")}, "generation": {"group_size": 2, "max_tokens": 3},
           "controller": {"steps": 1, "prompts_per_step": 2}, "model": {"device": "cpu"},
           "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"}, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_eval_plays_an_environments_episodes_as_the_run_does(tmp_path, tiny_model_path, monkeypatch, capsys):
    (tmp_path / "hotcold.py").write_text(HOT_COLD)
    monkeypatch.chdir(tmp_path)  # `hotcold:HotCold` resolves from the current directory, as in the docs
    config = _config(tmp_path, env={"name": "hotcold:HotCold", "max_turns": 3, "max_episode_tokens": 96})
    assert main(["eval", config, "--model.path", tiny_model_path]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/rows"] == 4
    numbers = [v for v in result.values() if isinstance(v, float)]
    assert numbers and not any(math.isnan(v) for v in numbers)  # was eval/reward_mean NaN with exit 0
    assert 0.0 <= result["eval/reward_mean"] <= 1.0 and result["eval/accuracy"] == result["eval/reward_mean"]
    assert 1.0 <= result["eval/env/turns"] <= 3.0  # played through the agent loop: episodes of 1 to 3 turns
    assert "eval/sampled_accuracy" in result and "eval/turns_mean" not in result


def test_a_nan_result_is_an_error_with_its_reason(tmp_path, tiny_model_path, capsys):
    config = _config(tmp_path, rewards=[{"function": f"{__name__}:nan_reward", "isolation": "thread"}])
    assert main(["eval", config, "--model.path", tiny_model_path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    line = captured.err.strip()
    assert "\n" not in line and line.startswith("tokenmill: eval: eval/reward_mean")
    assert "NaN on 4 rows: no sample got a reward" in line


class EvenReply:
    """Solved by a reply whose first character has an even code point, three tries: the samples of an
    untrained tiny model solve some held-out episodes and fail others."""

    def reset(self, task):
        self.turns = 0
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, message):
        self.turns += 1
        text = message.get("content") or ""
        if text and ord(text[0]) % 2 == 0:
            return StepResult([], 1.0, True, {"solved": True})
        return StepResult([{"role": "user", "content": "again"}], 0.0, self.turns >= 3)


def test_eval_of_a_trained_env_checkpoint_gives_the_runs_held_out_numbers(tmp_path, tiny_model_path, capsys):
    import tokenmill

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in "abcdefghijkl"))
    tokenmill.train({
        "model": {"path": tiny_model_path, "device": "cpu"}, "data": {"path": str(tmp_path / "rows.jsonl"),
                                                                      "num_eval": 8},
        "env": {"name": f"{__name__}:EvenReply", "max_turns": 3, "max_episode_tokens": 96},
        "generation": {"group_size": 2, "max_tokens": 3}, "training": {"learning_rate": 1e-3},
        "controller": {"steps": 2, "prompts_per_step": 2, "eval_samples": 3},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"}, "checkpoint": {"every": 0},
    })
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    before, after = ({k: v for k, v in r.items() if k.startswith("eval/")} for r in logged if "eval/rows" in r)
    capsys.readouterr()
    config = str(tmp_path / "run" / "config.yaml")  # the run's resolved config, as written beside it
    assert main(["eval", config, "--model.path", str(tmp_path / "run" / "final")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == after  # every number, sampled ones too
    assert main(["eval", config, "--model.path", tiny_model_path]) == 0  # the weights the run started from
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == before
    # not a tie of empty numbers: sampled episodes are solved and failed
    assert 0 < after["eval/sampled_accuracy"] < 1 and 0 < after["eval/pass@1"] < after["eval/pass@3"] <= 1
    print(before, after)
    assert after["eval/rows"] == 8 and after != before
