"""The `Reward` contract (rewards/base.py), run against every kind of reward that ships.

A reward has a `name` and a `weight`; called on a batch it returns one `RewardResult` per completion, in
order (a float, or None when it abstains or fails), reads dataset columns by name, scores a sample the same
whether it is alone or in a batch, and `close()` is idempotent.

Adding a kind is one entry in `REWARDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tokenmill.rewards.base import FunctionReward, Reward
from tokenmill.types import RewardResult

PROMPTS = ["1+1=", "2+1=", "say x: "]
COMPLETIONS = ["2", "4", "x"]
COLUMNS = {"answer": ["2", "3", "x"], "unused": [0, 1, 2]}


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def exact_one(prompt, completion, answer, **kwargs):
    return 1.0 if completion.strip() == answer else 0.0


def reward_model(path) -> Reward:
    from tokenmill.rewards.model import ModelReward

    return ModelReward(path, name="rm", weight=0.5, batch_size=2)


@dataclass(frozen=True)
class RewardSpec:
    make: Callable[[str], Reward]  # from the path of a one-label sequence classifier (used by model rewards)
    expected: list[float] | None  # by hand, where the values are known


REWARDS = {
    "function-process": RewardSpec(lambda _: FunctionReward(exact, isolation="process"), [1.0, 0.0, 1.0]),
    "function-thread": RewardSpec(lambda _: FunctionReward(exact, isolation="thread"), [1.0, 0.0, 1.0]),
    "function-per-sample": RewardSpec(lambda _: FunctionReward(exact_one, per_sample=True, name="exact"),
                                      [1.0, 0.0, 1.0]),
    "model": RewardSpec(reward_model, None),
}


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory, tiny_model_path) -> str:
    """A one-label Llama sequence classifier with the tiny model's tokenizer (random head, distinct scores)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(params=sorted(REWARDS))
def spec_and_reward(request, classifier_path):
    spec = REWARDS[request.param]
    reward = spec.make(classifier_path)
    yield spec, reward
    reward.close()


def test_name_weight_and_one_result_per_completion(spec_and_reward):
    spec, reward = spec_and_reward
    assert isinstance(reward.name, str) and reward.name
    assert isinstance(reward.weight, float)
    out = reward(PROMPTS, COMPLETIONS, COLUMNS)
    assert len(out) == len(COMPLETIONS) and all(isinstance(r, RewardResult) for r in out)
    assert all(r.value is None or isinstance(r.value, float) for r in out)
    if spec.expected is not None:
        assert [r.value for r in out] == spec.expected


def test_a_sample_scores_the_same_alone_in_a_batch_and_in_any_order(spec_and_reward):
    _, reward = spec_and_reward
    batch = [r.value for r in reward(PROMPTS, COMPLETIONS, COLUMNS)]
    alone = [reward([p], [c], {k: [v[i]] for k, v in COLUMNS.items()})[0].value
             for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True))]
    order = [2, 0, 1]
    shuffled = reward([PROMPTS[i] for i in order], [COMPLETIONS[i] for i in order],
                      {k: [v[i] for i in order] for k, v in COLUMNS.items()})
    assert alone == pytest.approx(batch, abs=1e-5)
    assert [r.value for r in shuffled] == pytest.approx([batch[i] for i in order], abs=1e-5)


def test_close_is_idempotent(spec_and_reward):
    _, reward = spec_and_reward
    reward.close()
    reward.close()
