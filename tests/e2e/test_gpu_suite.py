"""`benchmarks/gpu_suite.py`: its pieces on tiny shapes (CI), the whole `--small --device cpu` run (slow)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_suite

TINY_CFG = gpu_suite.SETTINGS["small"] | {"decode_batches": [2], "decode_new": 3, "train_seqs": [32],
                                          "train_tokens": 64, "table_new": 3, "table_micro_tokens": 256}
ARGS = type("Args", (), {"device": "cpu", "small": True})()


def test_the_async_ratio_is_the_step_over_the_slower_side():
    sync_run = {"step_seconds": [9, 9, 3.0, 3.2, 2.8],
                "stage_seconds": [{}, {}] + [{"generate": 1.8, "reward": 0.2, "train": 1.0, "sync": 0.1}] * 3}
    got = gpu_suite.overlap_ratio(sync_run, {"step_seconds": [5, 5, 2.2, 2.4, 2.3]})
    assert got["generate_s"] == 2.0 and got["train_s"] == 1.1 and got["ideal_s"] == 2.0
    assert got["async_step_s"] == 2.3 and got["ratio"] == 1.15 and got["steps_counted"] == 3
    assert got["speedup_over_sync"] == round(3.0 / 2.3, 3)


def test_the_async_runs_own_ratio_reads_its_metrics(tmp_path):
    rows = [{"timing_s/step": 9.0}] * 2 + [{"timing_s/step": 1.2, "timing_s/train": 0.9, "timing_s/sync": 0.1,
                                             "async/producer_generate_s": 0.7, "async/producer_reward_s": 0.1}] * 3
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"eval": 1}, *rows]))
    got = gpu_suite.own_stages(tmp_path)
    assert got == {"own_generate_s": 0.8, "own_train_s": 1.0, "own_ratio": 1.2}


def test_the_summary_sets_each_target_beside_the_measurement():
    report = {"parts": {"decode": {"by_batch": {256: {"fraction_of_bound": 0.55}, 32: {"fraction_of_bound": 0.2}}},
                        "train": {"rows": [{"seq_len": 16384, "mfu": {"tokenmill": 0.31, "prime_rl": 0.5}},
                                           {"seq_len": 16384, "mfu": {"tokenmill": 0.2, "prime_rl": 0.3}}]},
                        "async": {"ratio": 1.3}, "grpo": {"tokenmill": {"median_step_seconds": 1.4}}}}
    got = gpu_suite.summary(report)
    assert got["decode_fraction_256"]["met"] is True and got["decode_fraction_32"]["met"] is False
    assert got["mfu_16k"] == {"target": 0.30, "measured": 0.31, "met": True}
    assert got["mfu_4k"]["measured"] is None and got["mfu_4k"]["met"] is None
    assert got["grpo_step_seconds"]["met"] is True and got["async_ratio"]["met"] is False


def test_the_table_asks_the_estimate_first(tmp_path):
    cfg = gpu_suite.SETTINGS["full"]
    small = gpu_suite.estimated_peak(gpu_suite.QWEN3["Qwen3-0.6B"], cfg, False, "cuda", 80 * 2**30, tmp_path)
    big = gpu_suite.estimated_peak(gpu_suite.QWEN3["Qwen3-8B"], cfg, False, "cuda", 80 * 2**30, tmp_path)
    lora = gpu_suite.estimated_peak(gpu_suite.QWEN3["Qwen3-8B"], cfg, True, "cuda", 80 * 2**30, tmp_path)
    assert small["fits_by_estimate"] and not big["fits_by_estimate"]  # 8B x 16 bytes of model states alone
    assert big["estimate_total_gib"] > 8.1e9 * 16 / 2**30 and big["micro_batch_tokens"] == cfg["table_micro_tokens"]
    # LoRA's 8B fits once the micro-batch is what the budget solver says (16K tokens of activations do not)
    assert lora["fits_by_estimate"] and lora["micro_batch_tokens"] < cfg["table_micro_tokens"]
    assert lora["estimate_total_gib"] <= 80
    assert 0 < small["estimate_allocated_gib"] < small["estimate_total_gib"]


def test_a_table_step_generates_releases_and_updates(tmp_path):
    for lora in (False, True):
        got = gpu_suite.measured_step(gpu_suite.TINY["tiny-64"], TINY_CFG, lora, "cpu")
        assert got["generated_tokens"] > 8 * 8  # 8 prompts x 8 samples x up to 3 tokens
        assert got["peak_memory_gib"] is None  # measured on a GPU only


def test_the_train_and_decode_parts_run_on_tiny_shapes():
    stop = time.monotonic() + 600
    train = gpu_suite.train_part(ARGS, TINY_CFG, gpu_suite.TINY["tiny-64"], stop)
    assert [(r["activation_checkpointing"], r["seq_len"]) for r in train["rows"]] == [(False, 32), (True, 32)]
    assert all(r["tokens_per_s"] > 0 for r in train["rows"]) and train["profile"]["seq_32"]
    decode = gpu_suite.decode_part(ARGS, TINY_CFG, gpu_suite.TINY["tiny-64"], stop)
    assert decode["by_batch"][2]["tokens_per_s"] > 0
    paged = {(r["variant"], r["batch"]) for r in decode["paged"]["rows"]}  # the paged variants ran beside it
    assert {("paged_gather", 2), ("paged_device", 2)} <= paged, decode["paged"]


@pytest.mark.slow
def test_the_small_suite_runs_end_to_end_on_a_cpu(tmp_path):
    out = tmp_path / "suite.json"
    gpu_suite.main(["--small", "--device", "cpu", "--commit", "abc1234", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["machine"]["commit"] == "abc1234" and set(report["parts"]) == set(gpu_suite.PARTS)
    assert not [name for name, part in report["parts"].items() if "error" in part or "skipped" in part]
    assert report["parts"]["async"]["steps_counted"] == 20 and report["parts"]["async"]["ratio"] > 0
    assert report["parts"]["async"]["own_ratio"] > 0
    assert report["parts"]["largest"]["largest"] == {"full": "tiny-128", "lora": "tiny-128"}
    assert report["parts"]["grpo"]["step_speedup_vs_trl"] > 0
