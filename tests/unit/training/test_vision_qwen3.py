"""Qwen3-VL as a policy: loaded through the Auto classes, its tower (deepstack mergers included) frozen by
default, LoRA on its language model, and a GRPO run on the `shapes` task that trains."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("qwen3-vl") / "model", hidden_size=32, family="qwen3_vl")


def _load(path, **model):
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device

    return load_policy(ModelConfig(path=path, **model), resolve_device("cpu"))


def test_qwen3_vl_freezes_its_tower_and_takes_lora_on_the_language_model(qwen3_path):
    model, _ = _load(qwen3_path)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any("deepstack_merger_list" in n for n in frozen) and not any(".visual." in n for n in trainable)
    adapted, _ = _load(qwen3_path, lora={"rank": 4})
    lora = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n and "language_model" in n for n in lora)


def test_grpo_on_shapes_trains_a_qwen3_vl(tmp_path, qwen3_path):
    """Three GRPO steps: the sampler's logprobs are the trainer's (mismatch under 1e-5), gradients flow into
    the language model, the frozen tower keeps its weights, and `final/` loads back as a Qwen3-VL."""
    from transformers import AutoModelForImageTextToText

    import tokenmill

    def early_letters(completions, **kwargs):  # a reward the random policy's samples differ on
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # TRL's conversational form
        return [float(sum(ch < "m" for ch in text)) for text in texts]

    out = tmp_path / "run"
    result = tokenmill.train({
        "model": {"path": qwen3_path},
        "data": {"task": "shapes", "num_train": 32, "num_eval": 4},
        "generation": {"group_size": 4, "max_tokens": 4},
        "training": {"learning_rate": 1e-2},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0},
    }, rewards=[early_letters])
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "grad_norm" in x]
    assert len(steps) == 3 and result["eval_after"]["eval/rows"] == 4
    assert max(x["grad_norm"] for x in steps) > 0
    assert max(x["mismatch/max_abs"] for x in steps) < 1e-5
    before = AutoModelForImageTextToText.from_pretrained(qwen3_path).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(out / "final").state_dict()
    assert type(AutoModelForImageTextToText.from_pretrained(out / "final")).__name__ == "Qwen3VLForConditionalGeneration"
    tower = [k for k in before if ".visual." in k]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in before if "language_model" in k)
