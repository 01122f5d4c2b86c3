"""The "write your own environment" example of docs/environments.md works as printed: under 30 lines,
importable by its 'module:Class' name, and it runs episodes through the agent loop with a real (tiny) model."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tokenmill.engines.local.hf import HFEngine
from tokenmill.envs import resolve_env
from tokenmill.recipes import MODEL
from tokenmill.recipes.tiny import build_tiny_model
from tokenmill.rollout.agent import AgentLimits, AgentLoop
from tokenmill.types import SamplingParams

PAGE = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def test_environment_example(tmp_path, monkeypatch):
    code = re.search(r"```python\n(# mygame\.py.*?)```", PAGE.read_text(), re.DOTALL).group(1)
    assert len(code.strip().splitlines()) < 30
    (tmp_path / "mygame.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mygame", None)
    factory = resolve_env("mygame:HotCold")
    tasks = __import__("mygame").hot_cold_tasks(4, seed=1)

    # the rules, by hand: a non-number is answered, a wrong guess gets a hint, the right one ends with reward 1
    env = factory()
    env.reset(tasks[0])
    assert env.step({"role": "assistant", "content": "hm"}).observation[0]["content"] == "digits only"
    wrong = 1 if tasks[0]["secret"] != 1 else 2
    assert env.step({"role": "assistant", "content": str(wrong)}).observation[0]["content"] in ("higher", "lower")
    right = env.step({"role": "assistant", "content": str(tasks[0]["secret"])})
    assert (right.reward, right.done) == (1.0, True)

    # and through the agent loop: every episode ends within the environment's 6 turns, policy tokens masked in
    engine = HFEngine.from_pretrained(build_tiny_model(tmp_path / "m", seed=0, **MODEL), seed=0)
    loop = AgentLoop(engine, engine.tokenizer, factory, SamplingParams(max_tokens=3, n=2),
                     AgentLimits(max_turns=10, max_episode_tokens=512))
    groups, _ = loop.rollout(tasks)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 8
    for s in samples:
        assert 1 <= s.row["turns"] <= 6
        assert s.reward in (0.0, 1.0)
        assert 0 < sum(s.loss_mask) < len(s.tokens)
