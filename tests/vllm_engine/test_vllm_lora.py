"""LoRA adapters into a real vLLM server (`VLLMLoRASync`): the server keeps the base model, a push sends only the
adapters, and requests naming the adapter sample from base + LoRA exactly as the trainer's merged model scores
them (within 1e-4); a second push replaces the adapter in place, and the base model stays untouched."""

from __future__ import annotations

import copy

import torch

from tokenmill.engines import vllm
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams


def _worst(engine: RemoteEngine, model, prompts: list[list[int]]) -> float:
    out = engine.generate(prompts, SamplingParams(max_tokens=8, n=2))
    return max(abs(a - b) for prompt, completions in zip(prompts, out) for c in completions
               for a, b in zip(c.logprobs, teacher_logprobs(model, prompt, c.token_ids)))


def _randomise(peft_model, seed: int) -> None:
    """Adapters as training leaves them (peft starts B at zero, which would make the adapter a no-op)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)


def _merged(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def test_lora_pushes_sample_as_the_merged_model(vllm_server, vllm_model, hf_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(hf_model)
    peft_model = get_peft_model(hf_model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    sync = vllm.VLLMLoRASync([vllm_server.url], tmp_path / "adapters", peft_model.peft_config["default"],
                             timeout_s=60)
    lora = RemoteEngine([vllm_server.url], pad_id=0, model=vllm.LORA_ADAPTER_NAME)
    plain = RemoteEngine([vllm_server.url], pad_id=0)
    prompts = [[7 + (i * 13) % 96 for i in range(300)], [10, 11, 12, 13], [20, 30, 40, 50, 60]]
    trained = lambda: ((n, p) for n, p in peft_model.named_parameters() if p.requires_grad)
    try:
        _randomise(peft_model, seed=1)
        sync.push(trained(), version=1)
        first = _merged(peft_model)
        on_first = _worst(lora, first, prompts)
        _randomise(peft_model, seed=2)
        sync.push(trained(), version=2)  # in place, under the same name
        second = _merged(peft_model)
        on_second, still_first = _worst(lora, second, prompts), _worst(lora, first, prompts[1:])
        base_kept = _worst(plain, base, prompts[1:])
    finally:
        lora.close()
        plain.close()
        sync.close()
    assert on_first <= 1e-4, f"adapter v1: vLLM is {on_first:.3g} from the merged model"
    assert on_second <= 1e-4, f"adapter v2: vLLM is {on_second:.3g} from the merged model"
    assert still_first > 1e-2  # the second push replaced the first adapter
    assert base_kept <= 1e-4  # requests without the adapter's name sample the base model
    adapter = tmp_path / "adapters" / "v00000002"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert (adapter / "adapter_model.safetensors").stat().st_size < model_bytes / 4  # adapters, not the model
    assert not (tmp_path / "adapters" / "v00000001").exists()


def test_a_lora_grpo_run_pushes_adapters_and_vllm_ends_on_the_trained_model(vllm_server, train_on_vllm, hf_model,
                                                                            tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train_on_vllm(out, [vllm_server.url], steps=3, learning_rate=5e-2, lora={"rank": 4, "alpha": 8.0})
    trained = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()  # merged export
    lora = RemoteEngine([vllm_server.url], pad_id=0, model=vllm.LORA_ADAPTER_NAME)
    plain = RemoteEngine([vllm_server.url], pad_id=0)
    prompts = [[10, 11, 12, 13], [20, 30, 40], [50, 8, 9, 60, 61]]
    try:
        on_trained, on_start, base_kept = _worst(lora, trained, prompts), _worst(lora, hf_model, prompts), \
            _worst(plain, hf_model, prompts)
    finally:
        lora.close()
        plain.close()
    assert on_trained <= 1e-4, f"vLLM's adapter is {on_trained:.3g} from the trained (merged) model"
    assert on_start > 1e-3, f"the run did not move the adapters (vLLM {on_start:.3g} from the start)"
    assert base_kept <= 1e-4  # the base model on the server was never replaced
    # the last adapter stays where vLLM reads it from (the older ones are removed)
    assert sorted(p.name for p in (out / "vllm-lora").iterdir()) == ["v00000003"]
