"""verifiers environments played through tokenmill's engine: real verifiers v1 environments (tests/verifiers_envs/),
a real tiny model behind the recording proxy. The samples' token ids are the engine's own (captured from its
`submit`), they decode to the conversation the environment saw, and the rewards are its rubric's."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tokenmill.controller.evaluate import evaluate_agent
from tokenmill.engines.local.hf import HFEngine
from tokenmill.envs.verifiers_env import load
from tokenmill.rollout.verifiers_rollout import VerifiersRollout
from tokenmill.types import SamplingParams

ENVS = Path(__file__).parents[2] / "verifiers_envs"


@pytest.fixture(autouse=True)
def envs_importable(monkeypatch):
    """The test environments import by id here and in the tool servers verifiers starts (`python -m ...`)."""
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS), os.environ.get("PYTHONPATH", "")]))


class EngineCalls:
    """The real serving engine's `submit`, watched: each call's prompt ids and the future it returned."""

    def __init__(self, actor: VerifiersRollout) -> None:
        self.calls, submit = [], actor.serving.submit

        def watched(prompt_ids, params, **kw):
            future = submit(prompt_ids, params, **kw)
            self.calls.append((list(prompt_ids), future))
            return future

        actor.serving.submit = watched



def _actor(model, tokenizer, env, **params) -> VerifiersRollout:
    return VerifiersRollout(env, HFEngine(model, tokenizer, seed=0), tokenizer, SamplingParams(**params), seed=1)


def test_single_turn_samples_are_the_engines_tokens_and_the_rubrics_rewards(tiny_model, tokenizer):
    env = load("tm_vf_sum", {"taskset": {"num_tasks": 3}})
    actor = _actor(tiny_model, tokenizer, env, max_tokens=6, n=3)
    engine = EngineCalls(actor)
    try:
        groups, info = actor.rollout(env.rows, version=4, first_group=10)
    finally:
        actor.close()
    assert [g.group_id for g in groups] == [10, 11, 12] and all(len(g.samples) == 3 for g in groups)
    assert info == {"verifiers/episodes": 9.0, "verifiers/failed": 0.0}
    assert len(engine.calls) == 9 and len({tuple(p) for p, _ in engine.calls}) == 3  # 3 tasks x 3 episodes
    for group, task in zip(groups, env.tasks, strict=True):
        for s in group.samples:
            prompt, reply = list(s.tokens[: s.prompt_len]), list(s.tokens[s.prompt_len :])
            # (a) the prompt is the chat template's rendering of the task; the rest is what the engine sampled
            user = [{"role": "user", "content": task.data.prompt}]
            rendered = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
            assert prompt == list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            replies = [(ids, lps) for p, f in engine.calls if p == prompt for ids, lps in _sampled(f)]
            assert reply in [ids for ids, _ in replies]
            assert list(s.logprobs[s.prompt_len :]) == next(lps for ids, lps in replies if ids == reply)
            assert list(s.logprobs[: s.prompt_len]) == [0.0] * s.prompt_len
            assert s.loss_mask == (0,) * s.prompt_len + (1,) * len(reply) and s.version == 4
            # the ids decode to the conversation the environment saw (its trace's messages)
            assert s.row["messages"][0] == {"role": "user", "content": task.data.prompt}
            assert s.row["messages"][1]["role"] == "assistant" and len(s.row["messages"]) == 2
            answer = s.row["messages"][1]["content"]
            assert tokenizer.decode(reply, skip_special_tokens=True) == answer
            # (b) the rubric: exact (weight 1) + has_digit (weight 0.5), and its metric
            exact = float(answer.strip() == task.data.answer)
            digit = float(any(c.isdigit() for c in answer))
            assert s.rewards == {"env": exact + 0.5 * digit, "exact": exact, "has_digit": 0.5 * digit}
            assert s.reward == exact + 0.5 * digit and s.reward_errors == {}
            assert s.row["info"] == {"reply_chars": float(len(answer))} and s.row["turns"] == 1


def _sampled(future) -> list[tuple[list[int], list[float]]]:
    return [(list(c.token_ids), list(c.logprobs)) for c in future.result()]


def test_greedy_evaluation_plays_one_episode_per_held_out_task(tiny_model, tokenizer):
    env = load("tm_vf_sum", {"taskset": {"num_tasks": 4}})
    actor = _actor(tiny_model, tokenizer, env, max_tokens=5, n=4)
    try:
        out = evaluate_agent(actor, env.rows, max_rows=3)
        again, _ = actor.rollout(env.rows[:1], group_size=2, params=SamplingParams(max_tokens=5, greedy=True))
    finally:
        actor.close()
    assert out["eval/rows"] == 3 and out["eval/env/turns"] == 1.0
    assert not math.isnan(out["eval/reward_mean"]) and not math.isnan(out["eval/sampled_reward_mean"])
    assert out["eval/env/reply_chars"] >= 0  # the environment's metric, logged as the agent loop's info
    first, second = again[0].samples
    assert first.tokens == second.tokens  # greedy: the same reply twice


def test_an_environment_that_raises_during_the_rollout_gives_unscored_samples(tiny_model, tokenizer, caplog):
    env = load("tm_vf_broken", {"taskset": {"fail_loading": False}})
    actor = _actor(tiny_model, tokenizer, env, max_tokens=3, n=2)
    try:
        groups, info = actor.rollout(env.rows)
    finally:
        actor.close()
    assert info["verifiers/failed"] == 2.0
    for s in groups[0].samples:
        assert math.isnan(s.reward) and s.rewards["env"] is None
        error = s.reward_errors["env"]
        assert "the judge is out to lunch" in error and "\n" not in error
        assert sum(s.loss_mask) > 0  # the tokens were still recorded
    assert any("failed" in r.getMessage() and "Traceback" not in r.getMessage() for r in caplog.records)


TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] }}}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL_CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The tiny model, taught (SFT on one conversation) to call `calc_add` on "2+3=" and answer with the
    result; its chat template renders tool calls back as the text the model writes (Hermes format)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tokenmill.config.schema import ModelConfig
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    root = tmp_path_factory.mktemp("tool")
    path = build_tiny_model(root / "base", hidden_size=32, num_layers=1, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    chat = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": TOOL_CALL},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    model, tok = load_policy(ModelConfig(path=path), resolve_device("cpu"))
    run_sft(model, tok, Dataset.from_dict({"messages": [chat]}), steps=80, batch_size=1, learning_rate=1e-2,
            messages_column="messages")
    return model.eval(), tok


@pytest.mark.slow  # the environment's tool server is a process of its own (~10-25 s to start)
def test_multi_turn_episode_with_a_tool_is_one_sample_of_the_engines_tokens(tool_model):
    model, tok = tool_model
    env = load("tm_vf_calc")
    actor = _actor(model, tok, env, max_tokens=80, n=1, greedy=True)
    engine = EngineCalls(actor)
    try:
        groups, info = actor.rollout(env.rows, version=2)
    finally:
        actor.close()
    assert info["verifiers/failed"] == 0.0
    [s] = groups[0].samples
    # the model called the environment's tool, read its answer and replied: two calls, one trajectory
    roles = [m["role"] for m in s.row["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"] and s.row["turns"] == 2
    assert s.row["messages"][2]["content"] == "5" and s.rewards == {"env": 1.0, "correct": 1.0}
    # the prompt ids of each call, the engine's sampled ids after each: the sample is exactly their chain
    (p1, f1), (p2, f2) = engine.calls
    [c1], [c2] = f1.result(), f2.result()
    assert p2[: len(p1) + len(c1.token_ids)] == p1 + list(c1.token_ids)
    assert list(s.tokens) == p2 + list(c2.token_ids)
    observation = len(p2) - len(p1) - len(c1.token_ids)
    assert s.loss_mask == (0,) * len(p1) + (1,) * len(c1.token_ids) + (0,) * observation + (1,) * len(c2.token_ids)
    assert list(s.logprobs) == [0.0] * len(p1) + list(c1.logprobs) + [0.0] * observation + list(c2.logprobs)
    assert tok.decode(s.tokens) == tok.apply_chat_template(s.row["messages"], tokenize=False)
    assert TOOL_CALL in tok.decode(c1.token_ids) and s.version == 2


def test_load_builds_the_env_and_one_row_per_task():
    env = load(str(ENVS / "tm_vf_sum.py"), {"taskset": {"num_tasks": 2}})
    assert env.rows == [{"prompt": "0+1=", "task": 0}, {"prompt": "1+2=", "task": 1}]
    assert type(env.env).__name__ == "SingleAgentEnv"
    assert env.env.config.agent.harness.id == "tokenmill-chat" and env.env.config.agent.runtime.type == "subprocess"


def test_a_packaged_multi_agent_env_gives_each_trace_its_own_tokens_and_reward(tiny_model, tokenizer):
    """verifiers' own `best-of-n` env over a taskset: n attempts per episode, each a trace recorded apart."""
    env = load("tm_vf_sum", {"id": "best-of-n", "n": 3, "taskset": {"num_tasks": 2}})
    assert type(env.env).__name__ == "BestOfNEnv"
    actor = _actor(tiny_model, tokenizer, env, max_tokens=4, n=1)
    engine = EngineCalls(actor)
    try:
        groups, info = actor.rollout(env.rows)
    finally:
        actor.close()
    assert info == {"verifiers/episodes": 6.0, "verifiers/failed": 0.0}  # 2 tasks x 3 traces
    assert len(engine.calls) == 6
    for group, task in zip(groups, env.tasks, strict=True):
        assert len(group.samples) == 3
        for s in group.samples:
            [reply] = [list(c.token_ids) for p, f in engine.calls if list(p) == list(s.tokens[: s.prompt_len])
                       for c in f.result() if list(c.token_ids) == list(s.tokens[s.prompt_len :])]
            answer = s.row["messages"][1]["content"]
            assert tokenizer.decode(reply, skip_special_tokens=True) == answer
            exact, digit = float(answer.strip() == task.data.answer), float(any(c.isdigit() for c in answer))
            assert s.reward == exact + 0.5 * digit  # this attempt's own rubric, not its siblings'
        top = max(s.reward for s in group.samples)
        assert [s.row["info"]["best"] for s in group.samples] == [float(s.reward == top) for s in group.samples]
