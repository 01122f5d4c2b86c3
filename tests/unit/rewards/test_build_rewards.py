"""`build_rewards`: a built-in task's checker and a user's function each run in a forked worker (killed on
timeout), and score the same."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config.schema import RLConfig
from tokenmill.data.build import build_datasets
from tokenmill.rewards.build import build_rewards
from tokenmill.rewards.isolation import ProcessCaller


def test_a_task_checker_and_a_user_function_score_in_workers(tmp_path: Path):
    (tmp_path / "mine.py").write_text("def exact(completions, answer, **_):\n"
                                      "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    cfg = RLConfig.model_validate({"model": {"path": "unused"}, "data": {"task": "addition", "num_train": 4},
                                   "rewards": [{"function": f"{tmp_path / 'mine.py'}:exact", "name": "mine"}],
                                   "tracking": {"output_dir": str(tmp_path / "run")}})
    rows, _, task_reward = build_datasets(cfg)
    rewards = build_rewards(cfg, task_reward=task_reward)
    try:
        task, mine = rewards.rewards
        assert isinstance(task._call, ProcessCaller) and isinstance(mine._call, ProcessCaller)
        row = rows[0]
        right, wrong = str(row["answer"]), str(row["answer"]) + "1"
        totals, _ = rewards.score([row["prompt"]] * 2, [right, wrong], {"answer": [row["answer"]] * 2})
        assert totals == [2.0, 0.0]  # both functions agree: 1 + 1 for the right answer, 0 + 0 for the wrong one
    finally:
        rewards.close()
