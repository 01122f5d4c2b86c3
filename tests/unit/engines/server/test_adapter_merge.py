"""`merge_adapters`: an adapter-only push (peft lora_A / lora_B) becomes the plain weights the peft model computes,
bit for bit, pushed again and again without adding the delta twice; what does not fit is refused by name."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def models(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.config.schema import LoRAConfig
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.training.lora import add_lora

    torch.manual_seed(0)
    peft = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                    LoRAConfig(rank=4, alpha=8.0), task_type="CAUSAL_LM", field="model.lora")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return peft, HFEngine(plain, AutoTokenizer.from_pretrained(tiny_model_path))


def _adapters(peft):
    return [(n, p.detach().clone()) for n, p in peft.named_parameters() if ".lora_" in n]


def test_merged_adapters_equal_what_the_peft_model_computes(models):
    from tokenmill.engines.server.weight_routes import merge_adapters
    from tokenmill.sync import merged_lora_weights

    peft, engine = models
    base: dict[str, torch.Tensor] = {}
    for seed in (1, 2):  # the second push replaces the first delta: the base is kept
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn_like(p) * 0.1)
        merged = merge_adapters(_adapters(peft), 8.0 / 4, engine, base)
        engine.update_weights(merged, version=seed)
        want = dict(merged_lora_weights(peft))
        assert sorted(n for n, _ in merged) == sorted(want) and len(want) == 7
        served = dict(engine.model.named_parameters())
        for name, tensor in want.items():
            assert torch.equal(served[name].detach(), tensor), name


def test_an_incomplete_or_foreign_adapter_push_is_refused(models):
    from tokenmill.engines.server.weight_routes import UpdateRefused, merge_adapters

    peft, engine = models
    adapters = _adapters(peft)
    with pytest.raises(UpdateRefused, match="needs both lora_A and lora_B"):
        merge_adapters([t for t in adapters if ".lora_B." not in t[0]], 2.0, engine, {})
    with pytest.raises(UpdateRefused, match="carries lora_A and lora_B weights only"):
        merge_adapters([("model.norm.weight", torch.ones(32))], 2.0, engine, {})
    with pytest.raises(UpdateRefused, match="the served model has no"):
        merge_adapters([("base_model.model.nope.lora_A.default.weight", torch.ones(4, 32)),
                        ("base_model.model.nope.lora_B.default.weight", torch.ones(32, 4))], 2.0, engine, {})
