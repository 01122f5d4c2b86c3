"""Reward functions written for TRL's GRPOTrainer run unchanged, and score exactly as TRL scores them.

The reward functions below are the examples of TRL's GRPOTrainer documentation, written out as users copy
them. They go through tokenmill's reward path (Generator.score -> RewardSet -> FunctionReward in a forked
worker), and TRL's own GRPOTrainer scores the same completions for comparison.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re

import pytest
import torch

from tokenmill.rewards import FunctionReward, RewardSet
from tokenmill.rewards.base import RewardState
from tokenmill.rollout.generator import Generator
from tokenmill.types import Completion, SamplingParams, StopReason

# ----------------------------------------------------------------------- TRL's documented reward functions


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for completion, t in zip(completions, task):
        if t == "math":
            rewards.append(1.0 if "4" in completion else -1.0)
        else:
            rewards.append(None)  # does not apply to this sample
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c) % 3) for c in completions]


def step_scaled(completions, trainer_state, **kwargs):
    # reward shaping on training progress, as TRL's docs show with trainer_state
    scale = trainer_state.global_step / trainer_state.max_steps
    return [scale * len(c) for c in completions]


def token_count(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def scaled_len(completions, scale, **kwargs):
    return [scale * len(c) for c in completions]


class ContainsDigit:  # a callable class instance: named after its class
    def __call__(self, completions, **kwargs):
        return [float(any(ch.isdigit() for ch in c)) for c in completions]


class AsyncJudge:  # an async __call__, as an LLM judge would have
    async def __call__(self, prompts, completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(c.startswith("\\")) for c in completions]


def logs_a_metric(completions, log_metric, log_extra, **kwargs):
    log_metric("mean_chars", sum(len(c) for c in completions) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    return [0.0] * len(completions)


# ------------------------------------------------------------------------------------------------ helpers

PLAIN_ROWS = [
    {"prompt": "2+2=", "ground_truth": "4", "task": "math"},
    {"prompt": "Say hi.", "ground_truth": "hi", "task": "chat"},
]
# two completions per row; each reward has samples on both sides of its test
PLAIN_TEXTS = [["The answer is \\boxed{4}", "4"], ["\\boxed{hi}", "hello there, how are you today?"]]

CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "2+2?"}],
     "ground_truth": "4"},
    {"prompt": [{"role": "user", "content": "Capital of France?"}], "ground_truth": "Paris"},
]
CHAT_TEXTS = [["<think>2 and 2</think><answer>4</answer>", "4"],
              ["<think>easy</think> <answer>Paris</answer>", "<think>x</think><answer>Paris</answer>"]]


def completions_for(tokenizer, texts):
    """The engine's output for these texts: their token ids as a sampled completion."""
    return [
        [Completion(tuple(tokenizer(t, add_special_tokens=False)["input_ids"]), (0.0,) * len(t), StopReason.STOP, t)
         for t in group]
        for group in texts
    ]


def score(tokenizer, rows, texts, fns, version=0, max_steps=0, isolation="process"):
    """Samples as the run builds them: Generator.score over the given completions."""
    from tokenmill.rollout.generator import encode_prompts

    rewards = RewardSet([FunctionReward(fn, isolation=isolation, timeout_s=10) for fn in fns], max_steps=max_steps)
    try:
        generator = Generator(None, tokenizer, rewards, SamplingParams(n=2))  # scoring only: no engine needed
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows])
        groups = generator.score(rows, prompt_ids, completions_for(tokenizer, texts), version=version)
        return [s for g in groups for s in g.samples], rewards
    finally:
        rewards.close()


# ---------------------------------------------------------------------------------- run unchanged


def test_documented_rewards_run_unchanged(tokenizer):
    samples, _ = score(tokenizer, PLAIN_ROWS, PLAIN_TEXTS, [reward_len, reward_func, math_reward_func])
    lengths = [23, 1, 10, 31]  # the completions' lengths in characters
    assert [s.rewards["reward_len"] for s in samples] == [-abs(20 - n) for n in lengths] == [-3, -19, -10, -11]
    assert [s.rewards["reward_func"] for s in samples] == [1.0, 0.0, 1.0, 0.0]
    # None: the math reward does not apply to the chat row, which is scored by the other two only
    assert [s.rewards["math_reward_func"] for s in samples] == [1.0, 1.0, None, None]
    assert all(not s.reward_errors for s in samples)
    assert [s.reward for s in samples] == [-3 + 1 + 1, -19 + 0 + 1, -10 + 1, -11 + 0]


def test_conversational_completions_are_assistant_messages(tokenizer):
    seen = {}

    def spy(prompts, completions, ground_truth, **kwargs):
        seen.update(prompts=prompts, completions=completions, ground_truth=ground_truth)
        return [0.0] * len(completions)

    samples, _ = score(tokenizer, CHAT_ROWS, CHAT_TEXTS, [format_reward_func, spy], isolation="thread")
    assert [s.rewards["format_reward_func"] for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert seen["completions"][0] == [{"role": "assistant", "content": "<think>2 and 2</think><answer>4</answer>"}]
    assert seen["prompts"] == [CHAT_ROWS[0]["prompt"]] * 2 + [CHAT_ROWS[1]["prompt"]] * 2
    assert seen["ground_truth"] == ["4", "4", "Paris", "Paris"]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_async_reward_is_awaited(tokenizer, isolation):
    samples, _ = score(tokenizer, PLAIN_ROWS, PLAIN_TEXTS, [async_reward_func], isolation=isolation)
    assert [s.rewards["async_reward_func"] for s in samples] == [23 % 3, 1 % 3, 10 % 3, 31 % 3]


@pytest.mark.parametrize("isolation", ["process", "thread", None])
def test_async_reward_called_from_inside_a_running_loop(isolation):
    # a notebook runs its cells inside an event loop; None: `invoke` itself, in the loop's thread
    from tokenmill.rewards.base import invoke

    async def notebook_cell():
        if isolation is None:
            return invoke(async_reward_func, {"prompts": ["p", "q"], "completions": ["ab", "abcd"]})
        reward = FunctionReward(async_reward_func, isolation=isolation)
        try:
            return [r.value for r in reward(["p", "q"], ["ab", "abcd"], {})]
        finally:
            reward.close()

    assert asyncio.run(notebook_cell()) == [2.0, 1.0]


def test_async_per_sample_reward():
    async def close_to(prompt, completion, answer):
        await asyncio.sleep(0.01)
        return -abs(int(completion) - int(answer))

    reward = FunctionReward(close_to, per_sample=True, isolation="thread")
    out = reward(["a", "b", "c"], ["3", "10", "7"], {"answer": ["5", "10", "4"]})
    assert [r.value for r in out] == [-2.0, 0.0, -3.0]


def test_trainer_state_completion_ids_and_logging(tokenizer):
    samples, rewards = score(tokenizer, PLAIN_ROWS, PLAIN_TEXTS, [step_scaled, token_count, logs_a_metric],
                             version=3, max_steps=12)
    assert [s.rewards["step_scaled"] for s in samples] == [3 / 12 * n for n in (23, 1, 10, 31)]
    # the character tokenizer: one token per character
    assert [s.rewards["token_count"] for s in samples] == [23.0, 1.0, 10.0, 31.0]
    assert rewards.drain_metrics() == {"reward_metric/mean_chars": (23 + 1 + 10 + 31) / 4}
    assert rewards.drain_metrics() == {}  # drained
    log = rewards.rewards[2].last_log
    assert log.extra == {"chars": [23, 1, 10, 31]}


def test_a_column_named_like_an_argument_does_not_break_the_call():
    reward = FunctionReward(reward_len, isolation="process")
    try:
        out = reward(["p"], ["x" * 5], {"timeout": [1], "kwargs": [2], "self": [3]})
        assert [r.value for r in out] == [-15.0]
    finally:
        reward.close()


# ------------------------------------------------------------------------------ equal to TRL's trainer


def _trl_rewards(tiny_model_path, tokenizer, rows, texts, fns, global_step, max_steps):
    """TRL's GRPOTrainer scoring these completions: its `_calculate_rewards` with the inputs its generation
    step builds (one dataset row per completion; conversational completions as one assistant message)."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from tokenmill.rewards.base import is_conversational

    args = GRPOConfig(output_dir=str(tiny_model_path) + "-trl", use_cpu=True, per_device_train_batch_size=2,
                      num_generations=2, report_to="none", max_steps=max_steps)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path), reward_funcs=fns, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.state.global_step, trainer.state.max_steps = global_step, max_steps
    inputs = [row for row, group in zip(rows, texts, strict=True) for _ in group]
    prompts = [row["prompt"] for row in inputs]
    flat = [t for group in texts for t in group]
    completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                   for p, t in zip(prompts, flat, strict=True)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in flat]
    with torch.no_grad():
        per_func = trainer._calculate_rewards(inputs, prompts, completions, ids)
    return {trainer.reward_func_names[k]: per_func[:, k].tolist() for k in range(len(fns))}


def _same(ours, theirs):
    # TRL keeps float32 and writes None as NaN; tokenmill keeps None for "does not apply"
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None and math.isnan(b)) or a == pytest.approx(b, rel=1e-6), (ours, theirs)


@pytest.mark.parametrize("conversational", [False, True])
def test_equal_to_trl_grpo_trainer(tiny_model_path, tokenizer, conversational):
    if conversational:
        rows, texts, fns = CHAT_ROWS, CHAT_TEXTS, [format_reward_func, step_scaled, token_count]
    else:
        rows, texts = PLAIN_ROWS, PLAIN_TEXTS
        fns = [reward_len, reward_func, math_reward_func, async_reward_func, step_scaled, token_count,
               functools.partial(scaled_len, scale=0.5), ContainsDigit(), AsyncJudge()]
    theirs = _trl_rewards(tiny_model_path, tokenizer, rows, texts, fns, global_step=3, max_steps=12)
    samples, _ = score(tokenizer, rows, texts, fns, version=3, max_steps=12)
    assert set(theirs) == set(samples[0].rewards)  # the same names: partials unwrapped, instances by class
    assert conversational or {"scaled_len", "ContainsDigit", "AsyncJudge"} <= set(theirs)
    for name, values in theirs.items():
        _same([s.rewards[name] for s in samples], values)
    # the values are not trivially equal: each reward tells some samples apart (but step_scaled on chat
    # completions, where len() counts the one assistant message, in TRL as here)
    constant = {name for name, values in theirs.items() if len(set(values)) == 1}
    assert constant == ({"step_scaled"} if conversational else set())
    if conversational:
        assert theirs["step_scaled"] == [3 / 12] * 4


def test_reward_state_has_trainer_state_fields():
    transformers = pytest.importorskip("transformers")
    from dataclasses import fields

    theirs = {f.name for f in fields(transformers.TrainerState)}
    ours = {f.name for f in fields(RewardState)}
    assert ours <= theirs


# --------------------------------------------------------------------------------------------- in a run

PROGRESS = '''
import json, os


def progress(completions, completion_ids, trainer_state, log_metric, **kwargs):
    log_metric("tokens", sum(len(i) for i in completion_ids) / len(completion_ids))
    with open(os.environ["PROGRESS_LOG"], "a") as f:
        f.write(json.dumps([trainer_state.global_step, trainer_state.max_steps, [len(i) for i in completion_ids]]))
        f.write("\\n")
    return [0.0] * len(completions)
'''


def test_a_run_hands_rewards_its_progress_token_ids_and_log_metric(tiny_model_path, tmp_path, monkeypatch):
    import json

    import tokenmill

    (tmp_path / "progress.py").write_text(PROGRESS)
    monkeypatch.setenv("PROGRESS_LOG", str(tmp_path / "progress.jsonl"))
    tokenmill.train({
        "model": {"path": tiny_model_path}, "data": {"task": "addition", "num_train": 50, "num_eval": 0},
        "rewards": [{"function": f"{tmp_path / 'progress.py'}:progress"}],
        "generation": {"group_size": 2, "max_tokens": 3}, "controller": {"steps": 3, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    })
    calls = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"reward/mean"' in line]
    # step k is generated with the weights of k - 1 updates, as TRL's global_step reads during generation
    assert [(c[0], c[1]) for c in calls] == [(0, 3), (1, 3), (2, 3)]
    assert [sum(c[2]) / len(c[2]) for c in calls] == [s["response_len/mean"] for s in steps]
    # what the function reported through TRL's log_metric is in the step's metrics
    assert [s["reward_metric/tokens"] for s in steps] == [s["response_len/mean"] for s in steps]
