"""A short GRPO run with `training.deterministic: true` on the in-process engine reads `mismatch/max_abs`
exactly 0.0 at every step and TIS weighs every token by exactly 1 (the engine reports the scoring pass's
logprobs, `controller.rl.exact_logprobs`); the same run without it shows the decode pass's gap."""

from __future__ import annotations

import torch

from tokenmill.testing.rewards import digit_share, metric_rows


def _run(model: str, folder, deterministic: bool, **sections) -> list[dict]:
    from tokenmill.config import RLConfig, load_config

    cfg = load_config(RLConfig, {
        "model": {"path": model}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 6, "temperature": 0.9},
        "algorithm": {"off_policy": "tis", "mini_batches": 2},
        "training": {"learning_rate": 1e-2, "deterministic": deterministic, "micro_batch_tokens": 64},
        "controller": {"steps": 3, "prompts_per_step": 3},
        "health": {"mismatch_every": 1}, "tracking": {"output_dir": str(folder), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False}, **sections,
    })
    return metric_rows(cfg, [digit_share])


def test_a_deterministic_run_has_zero_mismatch_and_unit_importance_weights(tiny_model_path, tmp_path, restored_torch):
    rows = _run(tiny_model_path, tmp_path / "exact", deterministic=True)
    assert len(rows) == 3 and all(r["mismatch/tokens"] > 0 for r in rows)
    assert [r["mismatch/max_abs"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["mismatch/kl"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["is_weight_mean"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["timing_s/rescore"] > 0 for r in rows)  # the scoring pass is timed as a stage of its own
    assert all(r["grad_norm"] > 0 for r in rows)  # the weights moved between steps: the engine followed them


def test_a_thread_engine_of_the_current_weights_has_zero_mismatch(tiny_model_path, tmp_path, restored_torch):
    """A copy of the policy decoding in a thread: pushed weights are the trainer's bits, and both sides run
    the mode's fixed thread count."""
    rows = _run(tiny_model_path, tmp_path / "thread", deterministic=True, engine={"placement": "thread"})
    assert [r["async/staleness_max"] for r in rows] == [0, 0, 0] and all(r["grad_norm"] > 0 for r in rows)
    assert [r["mismatch/max_abs"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["async/producer_rescore_s"] > 0 for r in rows)


def test_the_same_run_without_it_shows_the_decode_pass_gap(tiny_model_path, tmp_path):
    rows = _run(tiny_model_path, tmp_path / "decode", deterministic=False)
    assert all(0 < r["mismatch/max_abs"] < 1e-4 for r in rows)
    assert "timing_s/rescore" not in rows[0]


def test_only_deterministic_with_zero_mismatch_and_an_in_process_engine_makes_the_trainer_batch_invariant():
    from tokenmill.config import RLConfig, load_config
    from tokenmill.training.spec import TrainerSpec

    def invariant(placement: str = "colocated", **training) -> bool:
        cfg = load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}, "training": training,
                                     "engine": {"placement": placement}})
        return TrainerSpec.from_config(cfg, None).batch_invariant

    assert invariant(deterministic=True) and invariant("thread", deterministic=True) and not invariant()
    assert not invariant(deterministic=True, zero_mismatch=False) and not invariant(zero_mismatch=True)
    # an engine in another process cannot score through the trainer's function: the trainer keeps its batches
    assert not invariant("process", deterministic=True) and not invariant("worker", deterministic=True)


def test_a_deterministic_thread_engine_runs_the_fixed_thread_count_like_the_trainer(monkeypatch):
    """Its scoring pass then reduces in the trainer's order; other placements keep their split."""
    import os

    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.placement import thread_split

    def cfg(placement: str, deterministic: bool):
        return load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"},
                                      "engine": {"placement": placement}, "training": {"deterministic": deterministic}})

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.delenv("TOKENMILL_DETERMINISTIC_THREADS", raising=False)
    assert thread_split(cfg("thread", True)) == (1, 1) and thread_split(cfg("thread", False)) == (4, 4)
    assert thread_split(cfg("worker", True)) == (4, 4) and thread_split(cfg("colocated", True)) == (0, 0)
