"""SFT, DPO and reward-model runs write the same metrics.jsonl / events.jsonl rows as an RL step, through
the same logger: the loss each step returned, the margin and accuracy of the pairs, lr, grad norm, stage
timings and tokens/s; and the CLI commands write them into the output folder."""

from __future__ import annotations

import json

import pytest

from tokenmill.tracking import MetricsLogger
from tokenmill.training.preference import load_reward_model_for_training, run_dpo, run_reward_model
from tokenmill.training.sft import run_sft, sft_sample

STEP_KEYS = {"lr", "grad_norm", "timing_s/step", "timing_s/train", "timing_share/train", "throughput/train_tok_s",
             "throughput/e2e_tok_s", "bottleneck"}
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(4) for b in range(3)]


def _rows(folder) -> tuple[list[dict], list[dict]]:
    metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    return metrics, events


def _logged(folder, steps: int, run) -> tuple[list[float], list[dict], list[dict]]:
    logger = MetricsLogger(folder, steps, console="none")
    try:
        losses = run(logger)
    finally:
        logger.close()
    metrics, events = _rows(folder)
    return losses, metrics, events


def test_sft_rows(tiny_model, tmp_path):
    rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in PAIRS]
    losses, metrics, events = _logged(tmp_path, 4, lambda log: run_sft(
        tiny_model, _tokenizer(tiny_model), rows, steps=4, batch_size=4, learning_rate=1e-3, warmup_steps=2,
        logger=log))
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(STEP_KEYS | {"loss", "nll"} <= r.keys() for r in metrics)
    assert [r["nll"] for r in metrics] == pytest.approx(losses)
    assert [r["lr"] for r in metrics][:2] == pytest.approx([5e-4, 1e-3])  # linear warm-up over 2 steps
    tok = _tokenizer(tiny_model)
    lengths = [len(sft_sample(tok, r["prompt"], r["completion"]).tokens) for r in rows]
    for r in metrics:  # tokens/s: the step's tokens (4 sequences) over its train seconds, and over the step's
        tokens = r["throughput/train_tok_s"] * r["timing_s/train"]
        assert tokens == pytest.approx(round(tokens), abs=1e-3) and 4 * min(lengths) <= round(tokens) <= 4 * max(lengths)
        assert r["throughput/e2e_tok_s"] * r["timing_s/step"] == pytest.approx(tokens)
        assert r["grad_norm"] > 0 and r["bottleneck"] == "train"
    assert [(e["stage"], e["step"]) for e in events if e["event"] == "stage"] == [("train", s) for s in (1, 2, 3, 4)]


def test_dpo_rows_have_the_margin_and_accuracy(tiny_model, tmp_path):
    losses, metrics, _ = _logged(tmp_path, 3, lambda log: run_dpo(
        tiny_model, _tokenizer(tiny_model), PAIRS, steps=3, batch_size=4, learning_rate=1e-3, logger=log))
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(STEP_KEYS | {"loss", "margin", "accuracy"} <= r.keys() for r in metrics)
    assert [r["loss"] for r in metrics] == pytest.approx(losses)
    # step 1: the policy is its own reference, so every implicit margin is 0 and the DPO loss is log 2
    assert metrics[0]["margin"] == pytest.approx(0.0, abs=1e-6) and metrics[0]["loss"] == pytest.approx(0.6931, 1e-3)
    assert metrics[0]["accuracy"] == 0.0


def test_reward_model_rows(tiny_model_path, tmp_path):
    model, tok = load_reward_model_for_training(tiny_model_path)
    losses, metrics, _ = _logged(tmp_path, 2, lambda log: run_reward_model(
        model, tok, PAIRS, steps=2, batch_size=4, logger=log))
    assert [r["loss"] for r in metrics] == pytest.approx(losses)
    assert all(STEP_KEYS | {"margin", "accuracy"} <= r.keys() for r in metrics)
    assert 0.0 <= metrics[0]["accuracy"] <= 1.0


def test_cli_sft_writes_metrics_rows_into_its_output_dir(tiny_model_path, tmp_path, capsys):
    from tokenmill.cli import main

    out = tmp_path / "sft"
    argv = ["sft", "--model.path", tiny_model_path, "--data.task", "addition", "--data.num_train", "20",
            "--steps", "3", "--batch_size", "4", "--output_dir", str(out)]
    assert main(argv) == 0
    metrics, events = _rows(out)
    assert [r["step"] for r in metrics] == [1, 2, 3] and all(STEP_KEYS <= r.keys() for r in metrics)
    assert "step 3/3 |" in capsys.readouterr().out
    assert any(e["event"] == "stage" and e["stage"] == "train" for e in events)


def _tokenizer(model):
    from tokenmill.testing import build_tokenizer

    return build_tokenizer()
