"""The async controller: at max_staleness 0 it *is* the synchronous loop (same losses, same weights), the
staleness bound holds per sample, stale groups are dropped and counted, and failures name the producer."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

import tokenmill
from tokenmill.config import RLConfig, load_config
from tokenmill.controller.feeds import within_staleness
from tokenmill.types import ConfigError, Group, Sample, StopReason


def digit_share(prompts, completions, **_):
    """A dense reward (share of digits), so a random-init model gets non-zero advantages."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _config(model: str, out, **overrides) -> dict:
    cfg = {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 500, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"ppo_epochs": 2, "mini_batches": 2},
        "training": {"learning_rate": 1e-3, "seed": 3},
        "controller": {"steps": 5, "prompts_per_step": 4},
        "engine": {"threads": 1},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }
    for key, value in overrides.items():
        section, field = key.split(".")
        cfg.setdefault(section, {})[field] = value
    return cfg


def _steps(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def _final(out) -> dict[str, torch.Tensor]:
    return load_file(str(max((out / "checkpoints").glob("step_*")) / "model.safetensors"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


def test_async_at_staleness_zero_equals_the_synchronous_loop(model, tmp_path):
    torch.set_num_threads(1)
    sync, thread = tmp_path / "sync", tmp_path / "thread"
    tokenmill.train(_config(model, sync), rewards=[digit_share])
    tokenmill.train(_config(model, thread, **{"engine.placement": "thread"}), rewards=[digit_share])
    a, b = _steps(sync), _steps(thread)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):  # the same samples, rewards and losses, step for step
        assert (x["reward/mean"], x["loss"], x["grad_norm"]) == (y["reward/mean"], y["loss"], y["grad_norm"])
    assert len({r["loss"] for r in a}) > 1  # the losses moved, so equality is not trivial
    wa, wb = _final(sync), _final(thread)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the async run measured itself: no sample was stale, the buffer never held more than one batch
    assert all(r["async/staleness_max"] == 0 and r["async/dropped_stale_groups"] == 0 for r in b)
    assert all(0 <= r["async/buffer_fill"] <= 1 and 0 < r["async/generate_busy"] <= 1 for r in b)


def test_staleness_one_overlaps_and_stays_within_the_bound(model, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "k1"
    result = tokenmill.train(_config(model, out, **{"engine.placement": "thread", "controller.max_staleness": 1,
                                                    "controller.steps": 6}), rewards=[digit_share])
    rows = _steps(out)
    assert len(rows) == 6 and result["last_metrics"]["async/policy_version"] == 5
    # never more than one version behind, and the producer did run ahead (some samples one version old)
    assert max(r["async/staleness_max"] for r in rows) == 1
    assert sum(r["async/staleness_share/1"] for r in rows) > 0
    assert all(r["async/staleness_share/0"] + r["async/staleness_share/1"] == pytest.approx(1.0) for r in rows)
    assert all(r["async/dropped_stale_groups"] == 0 for r in rows)


def test_worker_placement_samples_from_the_pushed_weights(model, tmp_path):
    torch.set_num_threads(1)
    sync = tmp_path / "worker0"
    tokenmill.train(_config(model, sync, **{"engine.placement": "worker", "controller.steps": 4}),
                    rewards=[digit_share])
    rows = _steps(sync)
    assert len(rows) == 4 and len({r["loss"] for r in rows}) > 1
    # staleness 0: every rollout comes from the weights the trainer had just pushed through shared memory, so
    # the worker's logprobs are the trainer's (one update moves them by ~1e-2 here)
    assert all(r["mismatch/max_abs"] < 1e-4 and r["async/staleness_max"] == 0 for r in rows), \
        [r["mismatch/max_abs"] for r in rows]
    # (running ahead within the bound, and resuming: the stop-and-resume test below, with this placement too)


def _group(gid: int, versions: list[int]) -> Group:
    samples = tuple(
        Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0), prompt_len=1, prompt="p", completion="c",
               stop_reason=StopReason.STOP, version=v, group_id=gid)
        for v in versions
    )
    return Group(gid, samples)


def test_groups_older_than_the_bound_are_dropped():
    # training step 5 holds version 4: lag = 4 - version; a group goes when its oldest sample lags > 1
    groups = [_group(0, [4, 4]), _group(1, [3, 4]), _group(2, [2, 4]), _group(3, [1, 1])]
    kept, stale, lag = within_staleness(groups, step=5, k=1)
    assert [g.group_id for g in kept] == [0, 1] and [g.group_id for g in stale] == [2, 3]
    assert lag == {0: 3, 1: 1}


def slow_reward(prompts, completions, **_):
    time.sleep(0.3)
    return [0.0] * len(completions)


def test_a_producer_that_cannot_keep_up_fails_naming_the_placement(model, tmp_path):
    cfg = _config(model, tmp_path / "t", **{"engine.placement": "thread", "controller.rollout_timeout_s": 0.05})
    t0 = time.monotonic()
    with pytest.raises(tokenmill.types.TokenmillError, match=r"no rollout batch for step 1 within "
                       r"controller.rollout_timeout_s=0.05s .*placement thread"):
        tokenmill.train(cfg, rewards=[slow_reward])
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("overrides, field", [
    ({"controller.max_staleness": 2}, "controller.max_staleness"),
    ({"engine.placement": "remote"}, "engine.urls"),
    ({"engine.urls": ["http://127.0.0.1:1"]}, "engine.urls"),
    ({"engine.placement": "thread", "engine.sync": "files"}, "engine.sync"),
    ({"engine.placement": "process", "engine.sync": "inprocess"}, "engine.sync"),
    ({"engine.placement": "worker", "engine.sync": "broadcast"}, "engine.sync"),
    ({"engine.placement": "worker", "model.device": "cuda"}, "engine.placement"),
    ({"engine.num_servers": 2}, "engine.num_servers"),
    ({"controller.partial_rollouts": True}, "controller.partial_rollouts"),
    ({"algorithm.off_policy": "tis", "algorithm.loss": "gspo"}, "algorithm.off_policy"),
    ({"algorithm.off_policy": "vtrace"}, "algorithm.off_policy"),
    ({"algorithm.is_cap": 0.5}, "algorithm.is_cap"),
    ({"engine.placement": "gpu"}, "engine.placement"),
])
def test_bad_async_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}}, overrides)
    assert str(err.value).startswith(field), str(err.value)


def test_partial_rollouts_continue_with_new_weights_and_record_token_versions(tiny_model_path, tokenizer):
    import copy

    from transformers import AutoModelForCausalLM

    from tokenmill.controller.placement import ThreadPlacement
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.engines.local.partial import PartialRolloutEngine
    from tokenmill.training.local import token_logprobs
    from tokenmill.types import SamplingParams

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    old, new = copy.deepcopy(model), copy.deepcopy(model)  # the engine's module is updated in place
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    placement = ThreadPlacement(HFEngine(model, tokenizer, seed=0), partial_chunk=3)
    engine = placement.engine
    assert isinstance(engine, PartialRolloutEngine) and engine.chunk == 3 and engine.placement is placement
    placement.push(new.named_parameters(), version=7)  # staged: lands at the first chunk boundary
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = engine.generate(prompts, SamplingParams(max_tokens=8, n=2, temperature=1.0))
    groups = [Group(i, tuple(Sample(tokens=tuple(p) + c.token_ids, loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                                    logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="", completion="",
                                    stop_reason=c.stop_reason) for c in cs))
              for i, (p, cs) in enumerate(zip(prompts, out, strict=True))]
    stamped = [s for g in placement.stamp_versions(groups) for s in g.samples]
    crossed = [s for s in stamped if s.completion_len > 3]
    assert crossed, "the random tiny model should rarely stop within 3 tokens"
    for s in stamped:
        assert s.token_versions == (0,) * min(3, s.completion_len) + (7,) * max(0, s.completion_len - 3)
        assert s.version == (0 if s.token_versions[0] == 0 else 7)
    # the continued tokens' logprobs are the new weights' own (teacher-forced), the first chunk's the old
    for s in crossed:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            old_lp = token_logprobs(old(ids).logits, ids, 1.0)[0, s.prompt_len :]
            new_lp = token_logprobs(new(ids).logits, ids, 1.0)[0, s.prompt_len :]
        sampled = torch.tensor(s.logprobs[s.prompt_len :])
        torch.testing.assert_close(sampled[:3], old_lp[:3].float(), atol=1e-4, rtol=0)
        torch.testing.assert_close(sampled[3:], new_lp[3:].float(), atol=1e-4, rtol=0)
    assert engine.interrupted == len([s for s in stamped if s.completion_len > 3])


def test_async_with_partial_rollouts_trains_within_the_bound(model, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "partial"
    tokenmill.train(_config(model, out, **{"engine.placement": "thread", "controller.max_staleness": 1,
                                           "controller.partial_rollouts": True, "controller.partial_chunk_tokens": 2,
                                           "controller.steps": 4}), rewards=[digit_share])
    rows = _steps(out)
    assert len(rows) == 4 and max(r["async/staleness_max"] for r in rows) <= 1


@pytest.mark.parametrize("placement", ["thread", "worker"])
def test_async_stop_and_resume_records_the_trained_rows_not_the_generated_ones(model, tmp_path, placement):
    torch.set_num_threads(1)
    out = tmp_path / "resume"
    cfg = _config(model, out, **{"engine.placement": placement, "controller.max_staleness": 1,
                                 "controller.steps": 4, "controller.max_steps_per_run": 2})
    first = tokenmill.train(cfg, rewards=[digit_share])
    assert first["resumed_from"] == 0
    # the producer had drawn rows for step 3 (one version ahead) but the checkpoint holds the trained position:
    # 2 steps x 4 prompts
    state = torch.load(out / "checkpoints" / "step_00000002" / "trainer.pt", weights_only=True)
    assert state["data"] == {"epoch": 0, "index": 8}
    # the batches generated ahead were kept with the checkpoint: step 3 (from version 1), and step 4 (from
    # version 2) when the producer had started it before the stop (it is then completed, not dropped)
    batches = state["rollouts"]["batches"]
    assert [b["step"] for b in batches] in ([3], [3, 4])
    assert [b["data_state"]["index"] for b in batches] == [12, 16][: len(batches)]
    assert {s["version"] for g in batches[0]["groups"] for s in g["samples"]} == {1}
    saved = [[s["reward"] for g in b["groups"] for s in g["samples"]] for b in batches]
    second = tokenmill.train(cfg, rewards=[digit_share], checkpoint__resume=True)
    assert second["resumed_from"] == 2 and second["last_metrics"]["async/policy_version"] == 3
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the resumed run trained those very batches first (one version behind), then went on after their rows
    for row, rewards in zip(rows[2:], saved, strict=False):
        assert row["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert rows[2]["async/staleness_max"] == 1
    state = torch.load(out / "checkpoints" / "step_00000004" / "trainer.pt", weights_only=True)
    assert state["data"] == {"epoch": 0, "index": 16} and state["rollouts"] == {"batches": []}


def test_a_dead_remote_server_fails_naming_it(model, tmp_path):
    cfg = _config(model, tmp_path / "dead", **{"engine.placement": "remote", "engine.urls": ["http://127.0.0.1:9"],
                                               "engine.timeout_s": 2.0})
    t0 = time.monotonic()
    with pytest.raises(tokenmill.types.TokenmillError, match=r"127\.0\.0\.1:9"):
        tokenmill.train(cfg, rewards=[digit_share])
    assert time.monotonic() - t0 < 60


def test_async_multi_turn_episodes_run_ahead_within_the_bound(model, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "agent"
    cfg = _config(model, out, **{"engine.placement": "thread", "controller.max_staleness": 1,
                                 "controller.steps": 3})
    cfg["data"] = {"task": "guess_number", "num_train": 100, "num_eval": 0}
    cfg["env"] = {"name": "guess_number", "max_turns": 2, "max_episode_tokens": 64}
    tokenmill.train(cfg)
    rows = _steps(out)
    assert len(rows) == 3 and max(r["async/staleness_max"] for r in rows) <= 1
    assert sum(r["async/staleness_share/1"] for r in rows) > 0  # episodes did run a version ahead
    assert all(r["async/dropped_stale_groups"] == 0 for r in rows)


def test_generation_and_training_split_the_cores(monkeypatch):
    import os

    from tokenmill.controller.placement import thread_split

    def cfg(**engine):
        return load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}, "engine": engine})

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert thread_split(cfg()) == (0, 0)  # colocated: one pool
    assert thread_split(cfg(placement="remote", urls=["http://h:1"])) == (0, 0)  # other machines' cores
    assert thread_split(cfg(placement="thread")) == (4, 4)
    assert thread_split(cfg(placement="thread", threads=2)) == (2, 6)
    assert thread_split(cfg(placement="worker")) == (4, 4)
    assert thread_split(cfg(placement="process", num_servers=2)) == (2, 4)
    assert thread_split(cfg(placement="process", num_servers=3, threads=3)) == (3, 1)  # oversubscribed: 1 left
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert thread_split(cfg(placement="thread")) == (4, 2)  # the trainer never gets more than it had


def slow_digit_share(prompts, completions, **_):
    time.sleep(0.3)  # scoring is part of the producer's rollout: the trainer checkpoints while it runs
    return digit_share(prompts, completions)


def test_a_checkpoint_keeps_the_rollout_being_generated(model, tmp_path):
    """At a checkpoint after step s, the producer is still making step s + 1 (its rewards are slow): the
    checkpoint waits for it and keeps it, so a resume trains it instead of generating it again."""
    torch.set_num_threads(1)
    out = tmp_path / "inflight"
    cfg = _config(model, out, **{"engine.placement": "thread", "controller.max_staleness": 1,
                                 "controller.steps": 4, "checkpoint.every": 1, "checkpoint.keep_last": 10})
    tokenmill.train(cfg, rewards=[slow_digit_share])
    for s in (1, 2, 3):
        state = torch.load(out / "checkpoints" / f"step_{s:08d}" / "trainer.pt", weights_only=True)
        steps = [b["step"] for b in state["rollouts"]["batches"]]
        assert steps[:1] == [s + 1], (s, steps)
        assert steps == list(range(s + 1, s + 1 + len(steps)))
