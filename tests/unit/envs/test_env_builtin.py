"""The calculator (tool-using) and gymnasium-adapter environments, driven by written-out assistant turns."""

from __future__ import annotations

import pytest

from tokenmill.envs import env_tasks, resolve_env
from tokenmill.envs.calculator import CalculatorEnv, calculator_problem
from tokenmill.envs.gym import FROZEN_LAKE_ACTIONS, GymTextEnv
from tokenmill.envs.tools import HermesToolCallParser
from tokenmill.rollout.agent import parse_turn

PARSE = HermesToolCallParser().parse


def _call(op: str, a: int, b: int) -> dict:
    return parse_turn(f'<tool_call>{{"name": "calc", "arguments": {{"op": "{op}", "a": {a}, "b": {b}}}}}</tool_call>',
                      PARSE)


def test_calculator_tasks_are_reproducible_and_correct():
    rows = env_tasks("calculator", 50, seed=3)
    assert rows[:] == env_tasks("calculator", 50, seed=3)[:]
    assert len(set(rows["expression"])) == 50
    for row in rows:
        # the expression, evaluated, is the answer (parentheses make left-to-right order explicit)
        assert eval(row["expression"]) == row["answer"]
        assert row["operations"] == 2


def test_calculator_episode_needs_several_calls_and_rewards_the_right_answer():
    import random

    task = calculator_problem(random.Random(0), operations=2, digits=3)
    env = resolve_env("calculator", {"tool_cost": 0.25})()
    obs = env.reset(task)
    assert obs[1]["content"] == task["expression"]
    # do the two operations with the tool, as written
    first, op1, second, op2, third = task["expression"].replace("(", "").replace(")", "").split()
    names = {"+": "add", "-": "sub", "*": "mul"}
    r1 = env.step(_call(names[op1], int(first), int(second)))
    assert not r1.done and r1.reward == 0.0 and r1.observation[0]["role"] == "tool"
    partial = int(r1.observation[0]["content"])
    r2 = env.step(_call(names[op2], partial, int(third)))
    assert int(r2.observation[0]["content"]) == task["answer"]
    bad = env.step(parse_turn('<tool_call>{"name": "calc", "arguments": {"op": "pow", "a": 1}}</tool_call>', PARSE))
    assert bad.observation[0]["content"].startswith("error:") and not bad.done
    final = env.step({"role": "assistant", "content": f"The answer is {task['answer']}"})
    # two operations, three calls: one extra call costs 0.25
    assert final.done and final.reward == pytest.approx(0.75) and final.info == {"solved": True, "tool_calls": 3}


def test_calculator_wrong_answer_and_turn_limit():
    env = CalculatorEnv(max_turns=2)
    env.reset({"expression": "2 + 2", "answer": 4, "operations": 1})
    assert env.step({"role": "assistant", "content": "5"}).reward == 0.0
    env.reset({"expression": "2 + 2", "answer": 4, "operations": 1})
    assert not env.step(_call("add", 2, 2)).done
    assert env.step(_call("add", 2, 2)).done  # second turn of two


def test_gym_frozen_lake_solved_by_the_shortest_path():
    env = GymTextEnv("FrozenLake-v1", {"is_slippery": False}, action_names=FROZEN_LAKE_ACTIONS, max_turns=20)
    obs = env.reset({"seed": 0})
    assert "0-3 (0=left, 1=down, 2=right, 3=up)" in obs[0]["content"]
    assert obs[1]["content"] == "[S]FFF\nFHFH\nFFFH\nHFFG"  # the agent's cell in brackets, no ANSI codes
    moves = ["down", "1", "I go right", "2", "down", "right"]
    rewards, dones = [], []
    for move in moves:
        r = env.step({"role": "assistant", "content": move})
        rewards.append(r.reward)
        dones.append(r.done)
    assert rewards == [0, 0, 0, 0, 0, 1.0] and dones == [False] * 5 + [True]
    env.close()


def test_gym_invalid_action_costs_a_turn_without_stepping():
    env = GymTextEnv("FrozenLake-v1", {"is_slippery": False}, max_turns=2)
    first = env.reset({"seed": 0})[1]["content"]
    r = env.step({"role": "assistant", "content": "fly"})
    assert r.info == {"valid": False} and "invalid action" in r.observation[0]["content"] and not r.done
    r = env.step({"role": "assistant", "content": "0"})  # left into the wall: same square, out of turns
    assert r.done and r.observation[0]["content"].splitlines()[1:] == first.splitlines()
    with pytest.raises(ValueError, match="action_names"):
        GymTextEnv("FrozenLake-v1", action_names=["a", "b"])


def test_gym_falls_in_a_hole():
    env = resolve_env("gym", {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}})()
    env.reset({"seed": 0})
    env.step({"role": "assistant", "content": "2"})  # right
    r = env.step({"role": "assistant", "content": "1"})  # down into the hole at (1, 1)
    assert r.done and r.reward == 0.0 and r.info["terminated"] and r.observation == []
