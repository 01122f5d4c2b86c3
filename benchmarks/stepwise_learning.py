"""Step-wise agent training (`env.stepwise: true`) learns on an environment whose history rewrites itself.

    python benchmarks/stepwise_learning.py [--steps 30]

`ForgetfulDigits` (below) plays three turns; each turn's reward is the share of digits in it, and after every
turn the environment rewrites the conversation to the task message and that turn alone (`StepResult.history`),
so no single token sequence holds what the policy saw across turns: the run trains one sample per model call.
The policy is the tiny random-init Llama (2 layers, 64 wide), GRPO with 8 tasks x 8 episodes per step, 6 tokens a
turn, through `tokenmill`'s own run (`build_run`, `run_rl`). Reported over the first and the last five steps: the
mean episode return (0 to 3), the model calls (samples) per episode, and the share of calls cut at 6 tokens (a
cut turn ends its episode: `AgentLimits.end_on_truncation`). Writes
benchmarks/results/stepwise_learning.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tokenmill.envs.base import StepResult

RESULTS = Path(__file__).resolve().parent / "results" / "stepwise_learning.json"


class ForgetfulDigits:
    """Three turns rewarded with the share of digits in each; the conversation keeps the task and the last turn."""

    def reset(self, task):
        self.turns, self.first = 0, {"role": "user", "content": task["prompt"]}
        return [self.first]

    def step(self, message):
        self.turns += 1
        text = message["content"]
        return StepResult(observation=[{"role": "user", "content": f"more {self.turns}"}],
                          reward=sum(c.isdigit() for c in text) / max(1, len(text)), done=self.turns >= 3,
                          history=[self.first, {"role": "assistant", "content": text}])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl
    from tokenmill.recipes.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "model", hidden_size=64, num_layers=2)
        rows = Path(tmp) / "tasks.jsonl"
        rows.write_text("".join(json.dumps({"prompt": f"task {i}"}) + "\n" for i in range(64)))
        cfg = load_config(RLConfig, {
            "model": {"path": base},
            "data": {"path": str(rows), "num_eval": 0},
            "env": {"name": f"{Path(__file__).resolve()}:ForgetfulDigits", "stepwise": True, "max_turns": 3,
                    "max_episode_tokens": 256},
            "generation": {"group_size": 8, "max_tokens": 6, "temperature": 1.0},
            "training": {"learning_rate": 1e-3},
            "controller": {"steps": args.steps, "prompts_per_step": 8},
            "tracking": {"output_dir": str(Path(tmp) / "run"), "console": "none"},
            "checkpoint": {"every": 0},
        })
        run = build_run(cfg)
        try:
            run_rl(run)
        finally:
            run.close()
        metrics = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/mean" in m]
    first, last = steps[:5], steps[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    calls = lambda rows: sum(r["agent/mean_batch"] * r["agent/rounds"] for r in rows) / (64 * len(rows))
    result = {"steps": len(steps), "return_first5": mean(first, "reward/mean"),
              "return_last5": mean(last, "reward/mean"), "calls_per_episode_first5": calls(first),
              "calls_per_episode_last5": calls(last), "truncated_calls_first5": mean(first, "response_len/clip_ratio"),
              "truncated_calls_last5": mean(last, "response_len/clip_ratio")}
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
