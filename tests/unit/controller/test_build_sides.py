"""A built `Run` is its two sides: the trainer's (model, backend, reference, critic, teacher, update RNG, spec)
and the trainer thread's rollout side (engine, actor, evaluator, prompt source, rewards). An async producer gets a
rollout side of its own that shares only the rewards; the names the run had before the split still read, with a
warning naming the new place."""

from __future__ import annotations

import pytest


def _config(model: str, out, **engine):
    from tokenmill.config import RLConfig, load_config

    return load_config(RLConfig, {
        "model": {"path": model}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 4}, "algorithm": {"kl_coef": 0.1},
        "controller": {"steps": 1, "prompts_per_step": 2, **({"max_staleness": 1} if engine else {})},
        "tracking": {"output_dir": str(out), "console": "none"}, "checkpoint": {"every": 0, "save_final": False},
        **({"engine": engine} if engine else {}),
    })


def test_the_run_is_a_trainer_side_and_a_rollout_side(tiny_model_path, tmp_path):
    from tokenmill.controller import build_run
    from tokenmill.rollout.generator import Generator

    run = build_run(_config(tiny_model_path, tmp_path))
    try:
        trainer, side = run.trainer, run.rollout
        assert trainer.backend.model is trainer.model and trainer.reference is not None and trainer.critic is None
        assert trainer.spec.learning_rate == run.cfg.training.learning_rate and trainer.spec.distill is None
        assert trainer.update_rng.random() == __import__("random").Random(run.cfg.training.seed + 1).random()
        assert isinstance(side.actor, Generator) and side.evaluator is side.actor
        assert side.actor.engine is side.engine and side.actor.rewards is side.rewards
        assert side.engine.model is trainer.model  # colocated: the engine samples from the trainer's module
        with pytest.warns(DeprecationWarning, match=r"Run.model is Run.trainer.model"):
            assert run.model is trainer.model
        with pytest.warns(DeprecationWarning, match=r"Run.generator is Run.rollout.evaluator"):
            assert run.generator is side.evaluator
        with pytest.warns(DeprecationWarning):
            assert run.agent is None  # no environment: no agent loop
        with pytest.raises(AttributeError, match="no attribute 'modle'"):
            run.modle  # noqa: B018
    finally:
        run.close()


def test_a_producer_side_shares_only_the_rewards(tiny_model_path, tmp_path):
    from tokenmill.controller import build_run
    from tokenmill.controller.placement import build_placement, producer_side

    run = build_run(_config(tiny_model_path, tmp_path, placement="thread"))
    placement = build_placement(run)
    try:
        mine, theirs = run.rollout, producer_side(run, placement.engine)
        assert theirs.engine is placement.engine and theirs.engine is not mine.engine
        assert theirs.engine.model is not run.trainer.model  # the thread placement's own copy
        assert theirs.actor is not mine.actor and theirs.actor.engine is theirs.engine
        assert theirs.source is not mine.source and theirs.source.state_dict() == mine.source.state_dict()
        assert theirs.rewards is mine.rewards  # one reward set, scoring one caller at a time
        theirs.source.next_rows(2)
        assert theirs.source.state_dict() != mine.source.state_dict()  # the producer draws ahead on its own copy
    finally:
        placement.close()
        run.close()
