"""docs/scale-out.md's 2 x 8 GPU recipe (Qwen3-8B) is what the code says: its `tokenmill plan` output, its memory
per role (`tokenmill estimate`, from the model's config.json alone) and its weight-sync times (the throughput in
benchmarks/results/weight_sync.json) are recomputed from the page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tokenmill.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "scale-out.md"
# Qwen3-8B's published shape (the config.json of its model folder: the only file the estimate reads)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
            "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def _recipe() -> tuple[str, str, str]:
    """(the recipe's YAML, the plan it prints, the text after it)."""
    text = PAGE.read_text()
    section = text[text.index("### Recipe: Qwen3-8B on 2 x 8 GPUs"):]
    config = re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)
    plan = re.search(r"`tokenmill plan recipe.yaml`:\n\n```text\n(.*?)```", section, re.DOTALL).group(1)
    return config, plan, section


def _in_model_folder(tmp_path, monkeypatch, config: str) -> Path:
    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text(json.dumps(QWEN3_8B))
    (tmp_path / "recipe.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "recipe.yaml"


def test_the_recipes_plan_is_what_tokenmill_plan_prints(tmp_path, monkeypatch, capsys):
    config, plan, _ = _recipe()
    path = _in_model_folder(tmp_path, monkeypatch, config)
    assert main(["plan", str(path)]) == 0
    assert capsys.readouterr().out == plan


def test_the_recipes_memory_and_sync_time_are_the_estimates(tmp_path, monkeypatch):
    from tokenmill.estimate import estimate_for_config

    config, _, page = _recipe()
    section = " ".join(page.split())  # the page's lines wrap anywhere
    _in_model_folder(tmp_path, monkeypatch, config)
    tree = yaml.safe_load(config)
    est = estimate_for_config(tree, device_memory_gib=80)
    models = {m["role"]: m for m in est["models"]}
    gb = lambda n: f"{n / 1e9:.2f}"
    actor, reference = models["actor"], models["reference"]
    assert "engine" not in models  # the replicas generate on node 1, not on the trainer's GPUs
    assert (f"weights {gb(actor['bytes']['weights'])}, gradients {gb(actor['bytes']['gradients'])}, AdamW "
            f"{gb(actor['bytes']['optimizer'])}, FSDP buffers {gb(actor['bytes']['fsdp_buffers'])}, activations "
            f"{gb(actor['bytes']['activations'])}, logits {gb(actor['bytes']['logits'])}: peak "
            f"{gb(actor['peak_bytes'])}") in section
    assert (f"weights {gb(reference['bytes']['weights'])}, FSDP buffers {gb(reference['bytes']['fsdp_buffers'])}, "
            f"logits {gb(reference['bytes']['logits_nograd'])}: peak {gb(reference['peak_bytes'])}") in section
    [device] = est["devices"]
    assert device["fits"] and f"{gb(device['total_bytes'])} of {gb(device['budget_bytes'])} (80 GiB): fits" in section
    # the engine replica, by hand: bf16 weights and the KV cache of 64 sequences of 1280 tokens
    params = est["models"][0]["params"]
    per_token = 2 * QWEN3_8B["num_hidden_layers"] * QWEN3_8B["num_key_value_heads"] * QWEN3_8B["head_dim"] * 2
    assert f"bf16 weights {gb(2 * params)}" in section and f"1280 tokens {gb(64 * 1280 * per_token)}" in section
    assert f"{per_token:,} bytes a token" in section
    # the default micro-batch does not fit, as the page says
    tree["training"]["micro_batch_tokens"] = 8192
    assert f"says {gb(estimate_for_config(tree, device_memory_gib=80)['devices'][0]['total_bytes'])} GB" in section
    # the sync time from the measured throughput of the largest model of benchmarks/weight_sync.py
    row = json.loads((REPO / "benchmarks" / "results" / "weight_sync.json").read_text())["rows"][-1]
    assert f"{params:,}" in section and f"{gb(4 * params)} GB in fp32" in section
    for name in ("files", "broadcast"):
        rate = row[f"{name}_mb_per_s"]
        assert f"{rate} MB/s" in section
        fp32, bf16 = 4 * params / (rate * 1e6), 2 * params / (rate * 1e6)
        assert f"about **{fp32:.1f} s** ({bf16:.1f} s in bf16)" in section, name
