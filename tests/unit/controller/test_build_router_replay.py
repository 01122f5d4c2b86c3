"""A run with `training.router_replay` on a tiny Qwen3-MoE: the colocated engine records while r3 is on, the
samples the trainer gets carry the routing, a 2-step run completes with r2 and r3 alike, and a dense model is
refused at setup naming the field."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.controller import build_run, run_rl
from tokenmill.types import ConfigError


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=32, num_layers=2, num_experts=4,
                                top_k=2, expert_size=32)


def _cfg(path, out, mode):
    return load_config(RLConfig, {
        "model": {"path": path}, "data": {"task": "addition", "num_eval": 4},
        "generation": {"group_size": 2, "max_tokens": 4},
        "training": {"router_replay": mode, "learning_rate": 1e-3},
        "controller": {"steps": 2, "prompts_per_step": 2},
        "tracking": {"output_dir": str(out), "console": "none"}, "checkpoint": {"every": 0},
    })


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_a_run_with_router_replay_completes(moe_path, tmp_path, mode):
    run = build_run(_cfg(moe_path, tmp_path, mode))
    try:
        assert (run.rollout.engine._routing is not None) == (mode == "r3")  # only r3 records in the engine
        groups, _ = run.rollout.actor.rollout([dict(run.eval_rows[0])], version=0)
        samples = [s for g in groups for s in g.samples]
        if mode == "r3":  # every token's experts, from the engine (the last sampled token's unknown: -1)
            assert all(len(s.routes) == len(s.tokens) and len(s.routes[0]) == 4 for s in samples)
        else:  # r2 records in the trainer, at the update
            assert all(s.routes is None for s in samples)
        run_rl(run)
    finally:
        run.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)


def _process(path, out):
    cfg = _cfg(path, out, "r3")
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"placement": "process", "sync": "files"})})


def test_an_r3_run_through_spawned_servers_completes(moe_path, tmp_path, monkeypatch):
    """engine.placement process: `tokenmill serve --enable-return-routed-experts` records, the remote engine asks
    every request for its routing, and the completions the run trains on carry it."""
    from tokenmill.engines.remote.client import RemoteEngine

    seen = []
    generate = RemoteEngine.generate

    def keep(self, *args, **kwargs):  # the real call; what it returned is kept for the assertions
        out = generate(self, *args, **kwargs)
        seen.extend(c for group in out for c in group)
        return out

    monkeypatch.setattr(RemoteEngine, "generate", keep)
    run = build_run(_process(moe_path, tmp_path))
    try:
        run_rl(run)
    finally:
        run.close()
    assert seen and all(c.routes.shape[1] == 4 and (c.routes[:-1] >= 0).all() for c in seen)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)


def test_a_dense_model_is_refused(tiny_model_path, tmp_path):
    with pytest.raises(ConfigError, match="training.router_replay: .* has no mixture-of-experts router"):
        build_run(_cfg(tiny_model_path, tmp_path, "r3"))
