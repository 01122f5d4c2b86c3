"""`benchmarks/paged_decode.py`'s `run_decode_bench` (what the GPU suite calls) on a tiny model on the CPU: a
row per variant and batch, each with tokens/s and its ratio to the static cache, rows decoding every token."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from paged_decode import run_decode_bench


def test_run_decode_bench_reports_every_variant_against_static():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    variants = ("static", "paged_gather", "paged_device", "static_groups", "paged_groups")  # flex: unit tests
    report = run_decode_bench(model, [2, 8], 4, "cpu", prompt_tokens=20, repeats=1, variants=variants)
    got = {(r["variant"], r["batch"]) for r in report["rows"]}
    assert got == {(v, b) for v in variants[:3] for b in (2, 8)} | {
        ("static_groups", 8), ("paged_groups", 8)}
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["vs_static"] > 0
        assert (row["vs_static"] == 1.0) == row["variant"].startswith("static")
    groups = {r["variant"]: r for r in report["rows"] if r["batch"] == 8 and "kv_blocks" in r}
    # a group of 8 shares its prompt's full block: 1 + 8 blocks (+ scratch), against 8 x 2 for 8 prompts
    assert (groups["paged_groups"]["kv_blocks"], groups["paged_gather"]["kv_blocks"]) == (1 + 9, 1 + 16)
