"""The `Feed` contract (controller/feeds/), run against the feeds the loop chooses between.

For each step `get(step)` returns that step's groups (one per prompt, `group_size` samples each) and sampling
metrics; every sample comes from a policy version the staleness bound allows (step - 1 - max_staleness up to
step - 1); `push(step)` hands over version `step`; `state_dict()` holds the batches generated ahead; and at
staleness 0 a feed yields exactly the groups of the synchronous in-place feed.

Adding a feed is one entry in `FEEDS` (the config that selects it). The proxy feed's episodes come from an
external agent program; `tests/unit/controller/test_proxy_feed.py` runs it.
"""

from __future__ import annotations

from functools import partial

import pytest

from tokenmill.config.load import load_config
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import build_run
from tokenmill.controller.feeds import Feed, rollout_feed
from tokenmill.controller.rl import rollout

STEPS = 3
FEEDS = {  # name -> the config sections that make the loop choose it
    "inline": {"engine": {"placement": "colocated"}},
    "async-thread-k0": {"engine": {"placement": "thread", "threads": 1}, "controller": {"max_staleness": 0}},
    "async-thread-k1": {"engine": {"placement": "thread", "threads": 1}, "controller": {"max_staleness": 1}},
}


def config(model_path: str, out, sections: dict) -> RLConfig:
    tree = {
        "model": {"path": model_path},
        "data": {"task": "addition", "num_train": 64, "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 3},
        "controller": {"steps": STEPS, "prompts_per_step": 2},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"save_final": False},
    }
    for key, section in sections.items():
        tree[key] = {**tree.get(key, {}), **section}
    return load_config(RLConfig, tree)


def feed_steps(model_path: str, out, sections: dict) -> tuple[list[list[tuple]], list[int], dict]:
    """Run the feed for STEPS steps (no training: each push hands over the same weights as a new version)."""
    run = build_run(config(model_path, out, sections))
    cfg = run.cfg
    seen, versions = [], []
    try:
        with rollout_feed(run, partial(rollout, cfg), 0) as feed:
            methods = [n for n, v in vars(Feed).items() if callable(v) and not n.startswith("_")]
            assert {"get", "push", "state_dict", "close"} <= set(methods)
            assert all(callable(getattr(feed, m, None)) for m in methods) and hasattr(feed, "side")
            for step in range(1, STEPS + 1):
                groups, metrics = feed.get(step)
                assert isinstance(metrics, dict)
                assert len(groups) == cfg.controller.prompts_per_step
                assert all(len(g.samples) == cfg.generation.group_size for g in groups)
                lowest = max(0, step - 1 - cfg.controller.max_staleness)
                versions += [s.version for g in groups for s in g.samples]
                assert all(lowest <= s.version <= step - 1 for g in groups for s in g.samples)
                seen.append([tuple(s.tokens) for g in groups for s in g.samples])
                feed.push(step)
            state = feed.state_dict()
    finally:
        run.close()
    return seen, versions, state


@pytest.fixture(scope="module")
def inline_tokens(tiny_model_path, tmp_path_factory):
    return feed_steps(tiny_model_path, tmp_path_factory.mktemp("inline"), FEEDS["inline"])[0]


@pytest.mark.parametrize("name", sorted(FEEDS))
def test_feed_serves_each_step_within_the_staleness_bound(name, tiny_model_path, tmp_path, inline_tokens):
    tokens, versions, state = feed_steps(tiny_model_path, tmp_path, FEEDS[name])
    assert isinstance(state.get("batches"), list)
    staleness = FEEDS[name].get("controller", {}).get("max_staleness", 0)
    if staleness == 0:
        assert tokens == inline_tokens  # the synchronous loop, whoever generates
        assert versions == [step - 1 for step in range(1, STEPS + 1) for _ in range(4)]
