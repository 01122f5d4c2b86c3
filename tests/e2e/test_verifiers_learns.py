"""GRPO on a verifiers environment learns: the quickstart's addition task wrapped as a verifiers v1 environment
(its rubric: the exact answer), played by verifiers' own episode logic through tokenmill's recording proxy.

The tiny Llama gets the quickstart's sloppy warm start with its prompts as chat user messages (~60 s unloaded), then GRPO
on the environment's tasks; held-out greedy accuracy on tasks the run never trains on rises, and every
trained sample is the engine's own tokens (each step's samples are compared with what the serving engine
sampled for the same prompt ids).
"""

from __future__ import annotations

import json

import pytest
import torch

ADDITION_ENV = '''
"""The quickstart's addition problems as a verifiers v1 environment: the reply must be the exact sum."""
import verifiers.v1 as vf

from tokenmill.data.registry import task_splits


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 4000
    seed: int = 0


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self):
        rows, _, _ = task_splits("addition", self.config.num_tasks, 0, seed=self.config.seed)
        for row in rows:
            yield AdditionTask(AdditionData(prompt=row["prompt"], answer=row["answer"]), self.config.task)


__all__ = ["AdditionTaskset"]
'''


@pytest.fixture(scope="module")
def chat_warm(tmp_path_factory):
    from tokenmill.recipes import warm_start

    torch.set_num_threads(2)
    return warm_start(tmp_path_factory.mktemp("chat-warm"), num_eval=200, say=lambda _: None, chat=True)


def grpo_on_verifiers(warm, out, steps: int = 150, num_eval: int = 200, learning_rate: float = 5e-5,
                      log_every: int = 10):
    """The run and the samples it trained on, each checked against the engine's own sampled ids."""
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    env_file = out / "addition_env.py"
    out.mkdir(parents=True, exist_ok=True)
    env_file.write_text(ADDITION_ENV)
    cfg = load_config(RLConfig, {
        "model": {"path": str(warm)},
        "data": {"num_eval": num_eval},
        "env": {"verifiers": str(env_file), "kwargs": {"taskset": {"num_tasks": 4000}}},
        "generation": {"group_size": 8, "max_tokens": 6, "temperature": 1.0},
        "training": {"learning_rate": learning_rate, "seed": 0},
        "controller": {"steps": steps, "prompts_per_step": 16, "eval_every": 0, "eval_max_rows": num_eval},
        "tracking": {"output_dir": str(out), "console": "plain" if log_every < 10 else "none",
                     "log_every": log_every},
        "checkpoint": {"every": 0, "save_final": False},
    })
    run = build_run(cfg)
    actor = run.rollout.actor
    checked = {"samples": 0}
    sampled: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    submit = actor.serving.submit

    def watched(prompt_ids, params, **kw):  # the real engine's submit: remember what it sampled for each prompt
        future = submit(prompt_ids, params, **kw)
        future.add_done_callback(lambda f: sampled.setdefault(tuple(prompt_ids), []).extend(
            tuple(c.token_ids) for c in f.result()))
        return future

    actor.serving.submit = watched
    rollout = actor.rollout

    def checked_rollout(rows, *args, **kwargs):
        groups, info = rollout(rows, *args, **kwargs)
        for s in (s for g in groups for s in g.samples if not s.reward_errors):
            assert s.tokens[s.prompt_len :] in sampled[tuple(s.tokens[: s.prompt_len])]
            assert s.loss_mask == (0,) * s.prompt_len + (1,) * (len(s.tokens) - s.prompt_len)
            checked["samples"] += 1
        return groups, info

    actor.rollout = checked_rollout
    try:
        result = run_rl(run)
    finally:
        run.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in rows if "reward/mean" in r], checked["samples"]


@pytest.mark.slow
def test_grpo_on_a_verifiers_environment_raises_held_out_accuracy(chat_warm, tmp_path):
    torch.set_num_threads(2)
    result, steps, checked = grpo_on_verifiers(chat_warm, tmp_path / "run")
    before, after = result["eval_before"]["eval/accuracy"], result["eval_after"]["eval/accuracy"]
    print(f"verifiers addition: held-out greedy accuracy {before:.3f} -> {after:.3f}; "
          f"{checked} trained samples equal to the engine's ids")
    assert result["eval_after"]["eval/rows"] == 200
    assert 0.2 < before < 0.8, before
    assert after - before >= 0.10, (before, after)
    # every sample (trained, dynamic sampling's extra draws, evaluated) was the engine's tokens
    assert checked >= 150 * 16 * 8
    rewards = [r["reward/mean"] for r in steps]
    assert sum(rewards[-30:]) > sum(rewards[:30])
    assert all(r["verifiers/failed"] == 0 for r in steps)
