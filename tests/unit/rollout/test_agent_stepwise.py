"""Step-wise agent training (`env.stepwise`): an environment whose history rewrites itself (it keeps only the
task and the latest turn) gives one sample per model call with exactly the ids the engine read and sampled,
and the calls of an episode share its return and one per-episode group advantage."""

from __future__ import annotations

import math
import statistics

import pytest

from tokenmill.algorithms.advantages import assign_advantages
from tokenmill.envs.base import StepResult
from tokenmill.rollout.agent import AgentLimits, AgentLoop
from tokenmill.testing.logged import LoggedEngine
from tokenmill.types import SamplingParams

LIMITS = AgentLimits(max_turns=5, end_on_truncation=False)  # a turn cut at max_tokens does not end the episode


class ForgetfulEnv:
    """Up to three turns, each rewarded with the share of digits in it; the episode ends early on a turn with a
    '7'. After each turn the conversation is rewritten to the task message and that turn alone."""

    def reset(self, task):
        self.turns, self.first = 0, {"role": "user", "content": task["prompt"]}
        return [self.first]

    def step(self, message):
        self.turns += 1
        text = message["content"]
        reward = sum(c.isdigit() for c in text) / max(1, len(text))
        done = self.turns >= 3 or "7" in text
        return StepResult(observation=[{"role": "user", "content": f"again {self.turns}"}], reward=reward,
                          done=done, history=[self.first, {"role": "assistant", "content": text}])


@pytest.fixture
def engine(tiny_model, tokenizer):
    e = LoggedEngine(tiny_model, tokenizer, seed=4)
    e.calls = []
    return e


def test_one_sample_per_call_with_the_engines_own_ids(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, ForgetfulEnv, SamplingParams(max_tokens=6, n=3), LIMITS, stepwise=True)
    groups, _ = loop.rollout([{"prompt": "count"}, {"prompt": "sum 3"}])
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == len(engine.calls) and len({s.episode for s in samples}) == 6
    unused = list(engine.calls)
    for s in samples:
        prompt, completion = s.tokens[: s.prompt_len], s.tokens[s.prompt_len:]
        # the prompt is exactly what the engine read, the completion what it returned (each call once), and the
        # prompt is the chat template of the rewritten conversation
        call = next(c for p, c in unused if p == prompt and c.token_ids == completion)
        unused.remove((prompt, call))
        first = {"role": "user", "content": s.row["prompt"]}
        step = s.row["step"]
        if step == 0:
            expected = [first]
        else:  # the task and the previous turn only, then the environment's next question
            previous = next(o for o in samples if o.episode == s.episode and o.row["step"] == step - 1)
            expected = [first, {"role": "assistant", "content": previous.completion},
                        {"role": "user", "content": f"again {step}"}]
        assert list(prompt) == tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
        assert s.loss_mask == (0,) * s.prompt_len + (1,) * len(completion)
        assert s.logprobs[s.prompt_len:] == call.logprobs and not any(s.logprobs[: s.prompt_len])
    # the episode's calls carry its return (the sum of its steps' rewards), each its own step reward in `row`
    for ep in {s.episode for s in samples}:
        calls = sorted((s for s in samples if s.episode == ep), key=lambda s: s.row["step"])
        assert [c.row["step"] for c in calls] == list(range(len(calls)))
        assert all(c.reward == pytest.approx(math.fsum(o.row["step_reward"] for o in calls)) for c in calls)
    assert {len([s for s in samples if s.episode == ep]) for ep in {s.episode for s in samples}} != {1}


def test_group_advantages_are_per_episode(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, ForgetfulEnv, SamplingParams(max_tokens=6, n=4), LIMITS, stepwise=True)
    groups, _ = loop.rollout([{"prompt": "count"}, {"prompt": "sum 3"}])
    for g in assign_advantages(groups, "grpo"):
        returns = {s.episode: s.reward for s in g.samples}
        assert len(returns) == 4 and len(g.samples) > 4
        # by hand, over the 4 episodes (not the calls): (R - mean) / (unbiased std + 1e-4)
        mean, std = statistics.fmean(returns.values()), statistics.stdev(returns.values())
        for s in g.samples:
            assert s.advantage == pytest.approx((returns[s.episode] - mean) / (std + 1e-4), abs=1e-9)


def test_a_rewritten_history_fails_a_single_sequence_episode(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, ForgetfulEnv, SamplingParams(max_tokens=6, n=2), LIMITS)
    groups, _ = loop.rollout([{"prompt": "count"}])
    for s in groups[0].samples:
        # an episode whose first turn held a '7' ended there, needing no rewrite; every other one fails at its
        # first step, naming the fix
        if "7" not in s.row["messages"][1]["content"]:
            assert "set env.stepwise: true" in s.reward_errors["env"] and math.isnan(s.reward)
            assert s.row["turns"] == 1
