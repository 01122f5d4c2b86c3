"""Dense rewards for tests on random-init models (the share of digits in a completion, so that even an
untrained model's samples differ in reward and get non-zero advantages), and a short run's metric rows."""

from __future__ import annotations

from typing import Any


def digit_share(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The share of digits of each plain-text completion."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def chat_digit_share(prompts: list[Any], completions: list[list[dict[str, Any]]], **_: Any) -> list[float]:
    """`digit_share` of chat completions (each a list of messages; the first one's content is scored)."""
    return digit_share(prompts, [c[0]["content"] for c in completions])


def metric_rows(cfg: Any, rewards: list[Any]) -> list[dict[str, Any]]:
    """Run the RL config `cfg` in this process with `rewards` and return its `metrics.jsonl` rows, one a step."""
    import json
    from pathlib import Path

    from tokenmill.controller.build import build_run
    from tokenmill.controller.rl import run_rl

    run = build_run(cfg, rewards=rewards)
    try:
        run_rl(run)
    finally:
        run.close()
    path = Path(cfg.tracking.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
