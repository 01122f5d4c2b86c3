"""The `Rollout` contract (rollout/base.py), run against the single-turn generator and the agent loop.

`rollout(rows, version, first_group)` returns one group per row, numbered from `first_group`, each with the
configured number of samples; every sample is stamped with `version`, holds the tokens that were sampled
(prompt, policy and environment tokens) with a loss mask over the policy's own tokens only, and the sampler
logprobs of exactly those tokens, equal to a teacher-forced pass over the sample's own tokens within 1e-4;
rewards are finite numbers; the info is a dict of numbers.

Adding a rollout is one entry in `ROLLOUTS` (the config sections that make the run build it). The proxy
collector's episodes come from an external agent program: `tests/unit/controller/test_proxy_feed.py` runs it.
"""

from __future__ import annotations

import math

import pytest

from tokenmill.config.load import load_config
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import build_run
from tokenmill.rollout.base import Rollout
from tokenmill.testing.reference import teacher_logprobs

ROLLOUTS = {
    "generator": {"data": {"task": "addition", "num_train": 16, "num_eval": 0}},
    "agent-loop": {"data": {"task": "guess_number", "num_train": 16, "num_eval": 0},
                   "env": {"name": "guess_number", "max_turns": 3}},
}


@pytest.fixture(params=sorted(ROLLOUTS))
def run(request, tiny_model_path, tmp_path):
    tree = {"model": {"path": tiny_model_path}, "generation": {"group_size": 3, "max_tokens": 4},
            "controller": {"steps": 1, "prompts_per_step": 2},
            "tracking": {"output_dir": str(tmp_path), "console": "none"}, **ROLLOUTS[request.param]}
    run = build_run(load_config(RLConfig, tree))
    yield run
    run.close()


def test_rollout_returns_stamped_groups_of_sampled_tokens(run):
    actor = run.rollout.actor
    assert isinstance(actor, Rollout)
    rows = run.rollout.source.next_rows(2)
    groups, info = actor.rollout(rows, version=7, first_group=5)
    assert [g.group_id for g in groups] == [5, 6]
    assert isinstance(info, dict) and all(isinstance(v, (int, float)) for v in info.values())
    model = run.trainer.model.eval()
    for group in groups:
        assert len(group.samples) == run.cfg.generation.group_size
        for s in group.samples:
            assert s.version == 7 and s.group_id == group.group_id
            assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs)
            assert not any(s.loss_mask[: s.prompt_len]) and any(s.loss_mask)
            assert math.isfinite(s.reward)
            policy = [i for i, m in enumerate(s.loss_mask) if m]
            assert all(s.logprobs[i] == 0.0 for i in range(len(s.tokens)) if not s.loss_mask[i])
            # one teacher-forced pass over the whole trajectory gives each policy token's logprob
            full = teacher_logprobs(model, s.tokens[:1], s.tokens[1:])
            assert [s.logprobs[i] for i in policy] == pytest.approx([full[i - 1] for i in policy], abs=1e-4)
