"""DAPO's overlong shaping and dynamic sampling."""

from __future__ import annotations

import json

import pytest

import tokenmill
from tokenmill.algorithms.shaping import has_spread, overlong_penalty, shape_overlong
from tokenmill.types import Group, Sample, StopReason


def test_overlong_penalty_by_hand():
    # max 10 tokens, buffer 4: free up to 6 tokens, then linear down to -factor; truncation costs -factor
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 8, 10)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(5, 10, 4, truncated=True) == -1.0
    assert overlong_penalty(8, 10, 4, factor=2.0) == -1.0
    assert overlong_penalty(10, 10, 0, truncated=True) == 0.0  # buffer 0 = off


def _sample(reward, n_completion, stop=StopReason.STOP):
    return Sample(tokens=(1,) * (2 + n_completion), loss_mask=(0, 0) + (1,) * n_completion,
                  logprobs=(0.0,) * (2 + n_completion), prompt_len=2, prompt="p", completion="c",
                  stop_reason=stop, reward=reward, rewards={"f": reward})


def test_shape_overlong_adds_and_logs_the_penalty():
    g = Group(0, (_sample(1.0, 3), _sample(1.0, 5), _sample(0.0, 6, StopReason.LENGTH)))
    (shaped,) = shape_overlong([g], max_tokens=6, buffer=2, factor=1.0)
    assert [s.reward for s in shaped.samples] == [1.0, 0.5, -1.0]
    assert [s.rewards["overlong"] for s in shaped.samples] == [0.0, -0.5, -1.0]
    assert shaped.samples[0].rewards["f"] == 1.0


def test_has_spread_ignores_failed_rewards():
    assert has_spread(Group(0, (_sample(1.0, 1), _sample(0.0, 1))))
    assert not has_spread(Group(0, (_sample(1.0, 1), _sample(1.0, 1), _sample(float("nan"), 1))))


def _config(model, out, **algo):
    return {
        "model": {"path": model}, "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4}, "algorithm": algo,
        "training": {"learning_rate": 1e-3}, "controller": {"steps": 2, "prompts_per_step": 3},
        "tracking": {"output_dir": str(out), "console": "none"}, "checkpoint": {"every": 0, "save_final": False},
    }


def _steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "sampling/dropped_groups" in r]


def test_dynamic_sampling_drops_flat_groups_and_skips_an_empty_update(tiny_model_path, tmp_path):
    def same_for_every_completion(prompts, completions, **_):
        return [1.0 for _ in completions]

    cfg = _config(tiny_model_path, tmp_path, dynamic_sampling=True, max_sampling_rounds=3)
    cfg["data"] = {"path": "x"}  # replaced by the in-memory dataset below
    from tokenmill.data.tasks import addition_dataset

    tokenmill.train(cfg, rewards=[same_for_every_completion], dataset=addition_dataset(50, seed=1))
    steps = _steps(tmp_path)
    # every group is flat: 3 rounds x 3 prompts dropped per step, nothing trained, the run goes on
    assert [r["sampling/dropped_groups"] for r in steps] == [9.0, 9.0]
    assert all("grad_norm" not in r for r in steps)


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_sampling_refills_the_step(tiny_model_path, tmp_path, dynamic):
    def by_length_parity(prompts, completions, **_):
        return [float(len(c) % 2) for c in completions]

    from tokenmill.data.tasks import addition_dataset

    cfg = _config(tiny_model_path, tmp_path, dynamic_sampling=dynamic)
    cfg["data"] = {"path": "x"}
    result = tokenmill.train(cfg, rewards=[by_length_parity], dataset=addition_dataset(50, seed=1))
    last = result["last_metrics"]
    if dynamic:
        # kept groups all have spread, and the step is refilled to 3 groups unless 3 rounds ran out
        assert last["groups/zero_variance_fraction"] == 0.0
        assert "sampling/dropped_groups" in last
    else:
        assert "sampling/dropped_groups" not in last
