"""The colocated loop hands memory back and forth: the engine's caches are released after each step's
rollouts (before the update), the trainer's gradients before the engine decodes."""

from __future__ import annotations


def test_a_colocated_run_releases_the_engine_once_a_step(tiny_model_path, tmp_path):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run
    from tokenmill.controller.rl import run_rl

    cfg = load_config(RLConfig, {
        "model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 4},
        "controller": {"steps": 3, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path), "console": "none"}, "checkpoint": {"every": 0, "save_final": False},
    })
    run = build_run(cfg)
    engine = run.rollout.engine
    engine.enable_prefix_cache(256, block=2)  # something the release must empty (the prompts are short)
    seen = []
    original = engine.release_memory

    def watched():
        seen.append(engine.prefix_cache.stats()["prefix_cache/tokens"])
        return original()

    engine.release_memory = watched
    try:
        run_rl(run)
    finally:
        run.close()
    assert engine.memory_releases == 3 and len(seen) == 3
    assert all(tokens > 0 for tokens in seen), seen  # each step's prompts were cached, then released
    assert engine.prefix_cache.stats()["prefix_cache/tokens"] == 0
    assert all(p.grad is None for p in run.trainer.model.parameters())
