"""The synthetic verifiable tasks: datasets, held-out splits and rewards on known answers."""

from __future__ import annotations

import os

import pytest

from tokenmill.data.registry import task_splits
from tokenmill.data.tasks import (
    addition_dataset,
    addition_reward,
    countdown_dataset,
    countdown_reward,
)


def test_addition_rows_are_correct_sums():
    ds = addition_dataset(50, seed=3)
    assert len(ds) == 50 and set(ds.column_names) == {"prompt", "completion", "answer"}
    for row in ds:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"].endswith("=")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert row["answer"] == row["completion"] == str(int(a) + int(b))
    assert len(set(ds["prompt"])) == 50  # no repeats when the space is large enough
    assert addition_dataset(50, seed=3)["prompt"] == ds["prompt"]  # seeded
    assert addition_dataset(50, seed=4)["prompt"] != ds["prompt"]


def test_addition_reward_on_known_answers():
    prompts = ["12+30=", "5+5=", "99+1=", "1+1=", "7+8="]
    completions = ["42", " 10\n", "100.", "2 2", ""]
    answers = ["42", "10", "100", "2", "15"]
    assert addition_reward(prompts, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0]
    ds = addition_dataset(5, seed=0)
    assert addition_reward(ds["prompt"], ds["completion"], answer=ds["answer"]) == [1.0] * 5


@pytest.mark.parametrize("task", ["addition", "countdown"])
def test_eval_prompts_are_disjoint_from_train(task):
    train, eval_, reward = task_splits(task, 300, 60, seed=1)
    assert len(eval_) == 60 and len(train) == 300
    assert not set(train["prompt"]) & set(eval_["prompt"])
    assert reward is {"addition": addition_reward, "countdown": countdown_reward}[task]
    _, no_eval, _ = task_splits(task, 10, 0)
    assert no_eval is None


def test_eval_disjoint_even_when_the_space_is_small():
    train, eval_, _ = task_splits("addition", 200, 30, digits=1)
    assert not set(train["prompt"]) & set(eval_["prompt"])


def test_countdown_rows_are_solvable():
    ds = countdown_dataset(40, seed=2)
    for row in ds:
        nums_text, target_text = row["prompt"].removesuffix(":").split(">")
        assert [int(x) for x in nums_text.split()] == row["nums"]
        assert int(target_text) == row["target"] >= 0
        assert all(1 <= x <= 9 for x in row["nums"]) and len(row["nums"]) == 3
    # the reference solution of every row is worth the full reward
    assert countdown_reward(ds["prompt"], ds["completion"], nums=ds["nums"], target=ds["target"]) == [1.0] * 40


def _cd(completions, nums, target):
    n = len(completions)
    return countdown_reward(["p"] * n, completions, nums=[nums] * n, target=[target] * n)


def test_countdown_requires_each_number_exactly_once():
    nums, target = [2, 3, 4], 14  # 2 + 3 * 4
    assert _cd(["2+3*4", "(3*4)+2", "4*3+2"], nums, target) == [1.0, 1.0, 1.0]
    assert _cd([
        "3*4+2+0",      # an extra number
        "2*7",          # right value, wrong numbers
        "3*4+2*1",      # extra 1
        "2+2+3*4-2",    # 2 used three times
        "3*4",          # a number missing (value 12, and wrong)
        "2+3+4",        # right numbers, wrong value (9)
    ], nums, target) == [0.1] * 6
    # repeated numbers must be used as often as they are given
    assert _cd(["2*2*6", "2*6"], [2, 2, 6], 24) == [1.0, 0.1]
    # division is exact arithmetic on the value
    assert _cd(["(8/4)*3"], [8, 4, 3], 6) == [1.0]


def test_countdown_unparsable_scores_zero():
    assert _cd(["", "two plus three", "2+", "(2+3", "2 3 4", "2.0+3*4", "-2+3*4+4", "2**3"], [2, 3, 4], 14) == [0.0] * 8


def test_countdown_division_by_zero_and_malicious_strings_score_zero_without_running(tmp_path):
    marker = tmp_path / "pwned"
    evil = [
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w').write('x')",
        "(lambda: 1)()",
        "[2, 3, 4]",
        "2 if True else 3",
        "().__class__.__mro__[1].__subclasses__()",
        "exec('x=1')",
    ]
    assert _cd(["2/(3-3)", "4/(2-2)*3"], [2, 3, 3], 1) == [0.0, 0.0]
    assert _cd(evil, [2, 3, 4], 14) == [0.0] * len(evil)
    assert not marker.exists()
    assert os.listdir(tmp_path) == []


def test_countdown_pathological_completions_score_zero():
    huge = "1" + "0" * 400
    chain = "+".join(["1"] * 3000)
    assert _cd([huge, chain, "2+3*4"], [2, 3, 4], 14) == [0.0, 0.0, 1.0]


def test_countdown_number_order_does_not_matter():
    assert _cd(["6*2*2", "2*(6*2)"], [2, 6, 2], 24) == [1.0, 1.0]


def test_forgot_carry_by_hand():
    from tokenmill.data.tasks import forgot_carry

    assert [forgot_carry(a, b) for a, b in [(47, 38), (67, 63), (12, 34), (99, 99), (5, 7), (9, 91)]] == [
        75, 120, 46, 188, 12, 90,
    ]


def test_slip_changes_demonstrations_only():
    clean, sloppy = addition_dataset(2000, seed=5), addition_dataset(2000, seed=5, slip=0.6)
    assert clean["prompt"] == sloppy["prompt"] and clean["answer"] == sloppy["answer"]
    wrong = [(p, c) for p, c, a in zip(sloppy["prompt"], sloppy["completion"], sloppy["answer"]) if c != a]
    from tokenmill.data.tasks import forgot_carry

    carries = sum(int(a) != forgot_carry(*map(int, p[:-1].split("+"))) for p, a in zip(clean["prompt"], clean["answer"]))
    assert 0.5 * carries < len(wrong) < 0.7 * carries  # ~60% of the problems with a carry
    # the reward scores the true sum, so a slip demonstration scores 0 and its true answer 1
    p, c = wrong[0]
    assert addition_reward([p], [c], answer=[str(sum(map(int, p[:-1].split("+"))))]) == [0.0]
