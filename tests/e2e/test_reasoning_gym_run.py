"""A `tokenmill.train` run on a reasoning-gym task: the rows come from the generator, every logged sample's reward
is the generator's own score_answer of the answer extracted from the completion, and samples.jsonl shows that
extracted answer."""

from __future__ import annotations

import json

import reasoning_gym

import tokenmill
from tokenmill.data.reasoning_gym import GymOptions, extract_answer

TASK = "reasoning_gym:spell_backward"
SETTINGS = {"min_word_len": 3, "max_word_len": 4}


def test_a_run_on_a_reasoning_gym_task_is_rewarded_by_score_answer(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    result = tokenmill.train({
        "model": {"path": tiny_model_path},
        "data": {"task": TASK, "task_kwargs": {**SETTINGS, "answer_format": "last_line"}, "num_train": 40,
                 "num_eval": 6},
        "generation": {"group_size": 2, "max_tokens": 6},
        "controller": {"steps": 2, "prompts_per_step": 3, "eval_max_rows": 6},
        "tracking": {"output_dir": str(out), "console": "none", "log_samples": 6},
        "checkpoint": {"save_final": False},
    })
    assert result["eval_after"]["eval/rows"] == 6
    generator = reasoning_gym.create_dataset("spell_backward", **SETTINGS, seed=0, size=1)
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 6
    options = GymOptions(answer_format="last_line")
    for r in records:
        word = r["prompt"].rpartition(" ")[2]
        extracted = extract_answer(r["completion"], options)
        assert r["extras"]["extracted_answer"] == extracted
        entry = {"question": r["prompt"], "answer": word[::-1], "metadata": {}}
        assert r["rewards"][TASK] == generator.score_answer(extracted, entry)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
