"""A 2-step GRPO run of a tiny Qwen3-MoE with `training.deterministic: true` and `training.router_replay: r3`
in bf16 autocast reads `mismatch/max_abs` exactly 0.0: the engine's scoring pass replays each sample's recorded
experts (`controller.rl.exact_logprobs`), as the trainer does. The control: the same run with a scoring pass
that routes afresh shows the gap of the tokens the bf16 decode pass sent to other experts. With r2 the trainer
records its own routes one row per sample (`LocalBackend.record_routes`), the experts the scoring pass picks;
its control records them in padded micro-batches, as a run without `deterministic` does."""

from __future__ import annotations

import pytest

from tokenmill.testing.rewards import digit_share, metric_rows


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=64, num_layers=2, num_experts=8,
                                top_k=2, expert_size=64)


def _run(model: str, folder, mode: str = "r3") -> list[dict]:
    from tokenmill.config import RLConfig, load_config

    cfg = load_config(RLConfig, {
        "model": {"path": model, "dtype": "bfloat16"}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 20, "temperature": 1.0},
        "algorithm": {"off_policy": "tis", "mini_batches": 2},
        "training": {"learning_rate": 1e-2, "deterministic": True, "router_replay": mode, "micro_batch_tokens": 64},
        "controller": {"steps": 2, "prompts_per_step": 6},
        "health": {"mismatch_every": 1}, "tracking": {"output_dir": str(folder), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    })
    return metric_rows(cfg, [digit_share])


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_a_deterministic_run_with_router_replay_has_zero_mismatch(moe_path, tmp_path, restored_torch, mode):
    rows = _run(moe_path, tmp_path / mode, mode)
    assert len(rows) == 2 and all(r["mismatch/tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert [r["mismatch/max_abs"] for r in rows] == [0.0, 0.0]
    assert [r["is_weight_mean"] for r in rows] == [1.0, 1.0]


def test_scoring_without_the_recorded_routes_shows_a_gap(moe_path, tmp_path, restored_torch, monkeypatch):
    from tokenmill.training import logprobs

    scoring = logprobs.rescore_groups
    monkeypatch.setattr(logprobs, "rescore_groups", lambda *a, **k: scoring(*a, **{**k, "replay": False}))
    rows = _run(moe_path, tmp_path / "afresh")
    assert max(r["mismatch/max_abs"] for r in rows) > 1e-3


def test_r2_routes_recorded_in_padded_micro_batches_show_a_gap(moe_path, tmp_path, restored_torch, monkeypatch):
    from tokenmill.training import local

    recorded = local.trainer_routes
    monkeypatch.setattr(local, "trainer_routes", lambda model, batch, _, amp: recorded(model, batch, 64, amp))
    rows = _run(moe_path, tmp_path / "batched", "r2")
    assert max(r["mismatch/max_abs"] for r in rows) > 1e-3
