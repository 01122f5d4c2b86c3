"""Loading a vision-language policy: the vision tower frozen by default, LoRA on the language model only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")


def _load(path, **model):
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device

    return load_policy(ModelConfig(path=path, **model), resolve_device("cpu"))


def _trainable(model):
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_the_vision_tower_is_frozen_by_default_and_switchable(tiny_vlm_path):
    model, _ = _load(tiny_vlm_path)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    trainable = _trainable(model)
    assert trainable and not any(".visual." in n for n in trainable)
    assert any("language_model" in n for n in trainable)
    unfrozen, _ = _load(tiny_vlm_path, freeze_vision=False)
    assert any(".visual." in n for n in _trainable(unfrozen))


def test_lora_adapts_the_language_model_only(tiny_vlm_path):
    model, _ = _load(tiny_vlm_path, lora={"rank": 4})
    trainable = _trainable(model)
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    with_tower, _ = _load(tiny_vlm_path, lora={"rank": 4}, freeze_vision=False)
    tower = {n for n in _trainable(with_tower) if ".visual." in n}
    assert tower and not any("lora_" in n for n in tower)  # the tower trains in full, not adapted


def test_an_sft_step_with_images_leaves_the_frozen_tower_unchanged(tiny_vlm_path):
    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.engines.local.vision import VisionProcessor, vision_tower
    from tokenmill.training.sft import run_sft
    from tokenmill.training.vision import image_sft_samples

    model, tok = _load(tiny_vlm_path)
    rows = shapes_dataset(8, seed=0)
    samples = image_sft_samples(VisionProcessor.from_pretrained(tiny_vlm_path, tokenizer=tok), rows)
    assert all(s.images is not None and s.images.num_images == 1 for s in samples)
    assert [tok.decode(s.tokens[s.prompt_len:-1]) for s in samples] == rows["completion"]
    tower = {k: v.clone() for k, v in vision_tower(model).state_dict().items()}
    head = model.lm_head.weight.detach().clone()
    losses = run_sft(model, tok, None, samples=samples, steps=3, batch_size=8, learning_rate=1e-2)
    assert losses[-1] < losses[0]
    assert all(torch.equal(tower[k], v) for k, v in vision_tower(model).state_dict().items())
    assert not torch.equal(head, model.lm_head.weight)
