"""Router replay r3 over agent episodes: a multi-turn episode's routing is each call's, token by token, taken from
the call that read the token first (the turn that sampled it; an observation from the next call's prompt), and a
step-wise sample carries exactly its own call's routing."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.envs.base import StepResult
from tokenmill.rollout.agent import AgentLimits, AgentLoop
from tokenmill.testing.logged import LoggedEngine
from tokenmill.types import SamplingParams

LIMITS = AgentLimits(max_turns=3, end_on_truncation=False)


class ThreeTurns:
    def reset(self, task):
        self.turns = 0
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, message):
        self.turns += 1
        return StepResult(observation=[{"role": "user", "content": f"again {self.turns}"}], reward=1.0,
                          done=self.turns >= 3)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.testing import build_tiny_moe_model

    path = build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=32, num_layers=2, num_experts=4,
                                top_k=2, expert_size=32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _engine(moe):
    model, tok = moe
    engine = LoggedEngine(copy.deepcopy(model), tok, seed=2)
    engine.calls = []
    engine.record_routing(True)
    return engine


def test_an_episodes_routing_comes_from_the_call_that_read_each_token_first(moe):
    engine = _engine(moe)
    loop = AgentLoop(engine, moe[1], ThreeTurns, SamplingParams(max_tokens=5, n=2), LIMITS)
    groups, _ = loop.rollout([{"prompt": "count"}])
    for s in (s for g in groups for s in g.samples):
        calls = [(p, c) for p, c in engine.calls if s.tokens[: len(p) + len(c.token_ids)] == p + c.token_ids]
        assert len(calls) == 3 and s.routes.shape == (len(s.tokens), 4)
        start = 0
        for prompt, turn in calls:
            end = len(prompt) + len(turn.token_ids) - 1  # the turn's last token is read by the next call
            assert torch.equal(s.routes[start:end], turn.routes[start:end])
            start = end
        assert (s.routes[start:] == -1).all()  # the last turn's final token, and the observation after it
        assert (s.routes[:start] >= 0).all()


def test_a_stepwise_sample_carries_its_calls_routing(moe):
    engine = _engine(moe)
    loop = AgentLoop(engine, moe[1], ThreeTurns, SamplingParams(max_tokens=5, n=2), LIMITS, stepwise=True)
    groups, _ = loop.rollout([{"prompt": "count"}])
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == len(engine.calls) == 6
    for s in samples:
        [turn] = [c for p, c in engine.calls if p + c.token_ids == s.tokens]
        assert torch.equal(s.routes, turn.routes)
