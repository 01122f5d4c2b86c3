"""LoRA through peft: only the adapters train, bad targets are a config error naming the field."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config.schema import LoRAConfig, ModelConfig
from tokenmill.training.model import load_policy, parameter_counts
from tokenmill.types import ConfigError


def test_lora_trains_only_the_adapters(tiny_model_path):
    model, _ = load_policy(ModelConfig(path=tiny_model_path, lora=LoRAConfig(rank=4)), torch.device("cpu"))
    trainable, total = parameter_counts(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    # rank 4 on every linear layer of a 1-layer, 32-wide model: 4 * (in + out) per adapted layer
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert 0 < trainable < total
    # adapters start at zero (B = 0): the wrapped model computes exactly what the plain one does
    plain, _ = load_policy(ModelConfig(path=tiny_model_path), torch.device("cpu"))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_lora_unknown_target_is_a_config_error(tiny_model_path):
    cfg = ModelConfig(path=tiny_model_path, lora=LoRAConfig(rank=4, target_modules=["no_such_proj"]))
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        load_policy(cfg, torch.device("cpu"))


def test_weight_sync_sends_only_the_adapters(tiny_model_path):
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.training import LocalBackend

    model, tok = load_policy(ModelConfig(path=tiny_model_path, lora=LoRAConfig(rank=4)), torch.device("cpu"))
    backend = LocalBackend(model, learning_rate=1e-2, total_steps=1)
    sent = dict(backend.weights())
    assert sent and all("lora_" in n for n in sent)
    assert sum(t.numel() for t in sent.values()) == parameter_counts(model)[0]
    # a separate engine holding a copy of the same adapted model receives the adapters and then computes exactly
    # what the trainer's model computes after an update
    import copy

    engine = HFEngine(copy.deepcopy(model), tok)
    with torch.no_grad():
        for p in sent.values():
            p.add_(0.05)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert not torch.allclose(engine.model(input_ids=ids).logits, model(input_ids=ids).logits)
        engine.update_weights(backend.weights(), version=1)
        torch.testing.assert_close(engine.model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert engine.version == 1
