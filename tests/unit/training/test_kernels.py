"""`training.activation_checkpointing` and `training.kernels` (tokenmill.training.kernels): the same gradients
as the plain trainer; liger's fused ops against PyTorch's on a GPU; one line naming the extra without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill.algorithms.losses import LOSSES
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import collate
from tokenmill.training.local import LocalBackend
from tokenmill.types import ConfigError


def _loss(logprobs_B_T, micro):
    return LOSSES["ppo_clip"](logprobs_B_T, old_logprobs_B_T=micro.old_logprobs_B_T, advantages=micro.advantages,
                              weights_B_T=micro.weights_B_T, clip_low=0.2, clip_high=0.2, ref_logprobs_B_T=None,
                              kl_coef=0.0, kl_estimator="k3")


def _grads(path, device="cpu", dtype=torch.float32, **options):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=4, micro_batch_tokens=64, **options)
    samples = uneven_groups(3, model.config.vocab_size, ((5, 3, 6), (2, 4, 9), (7, 2, 3)))
    metrics = backend.forward_backward(collate(samples, [1.0 / len(samples)] * len(samples), pad_id=0), _loss,
                                       entropy_coef=0.01)
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}, metrics, model


def test_activation_checkpointing_gives_the_same_gradients(tiny_model_path):
    plain, plain_metrics, _ = _grads(tiny_model_path)
    recomputed, metrics, model = _grads(tiny_model_path, activation_checkpointing=True)
    layers = model.model.layers
    assert all(layer.gradient_checkpointing for layer in layers)  # the switch reached every decoder layer
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    for name, grad in plain.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert float((recomputed[name] - grad).abs().max() / scale) < 1e-6, name
    assert any(float(g.abs().max()) > 0 for g in plain.values())


def test_activation_checkpointing_recomputes_in_the_backward(tiny_model_path):
    """Checkpointing really changes what the backward does: a layer's MLP runs again in it."""
    calls = {"n": 0}

    def count(*_):
        calls["n"] += 1

    for on in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        model.model.layers[0].mlp.register_forward_pre_hook(count)
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=4096,
                               activation_checkpointing=on)
        samples = uneven_groups(0, model.config.vocab_size, ((4, 2, 5),))
        calls["n"] = 0
        backend.forward_backward(collate(samples, [0.5, 0.5], pad_id=0), _loss)
        assert calls["n"] == (2 if on else 1)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_liger_without_the_package_names_the_extra(tiny_model_path):
    with pytest.raises(ConfigError, match=r"^training.kernels: liger needs liger-kernel: pip install tokenmill\[kernels\]$"):
        _grads(tiny_model_path, kernels="liger")


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_on_a_cpu_policy_is_refused(tiny_model_path):
    with pytest.raises(ConfigError, match="training.kernels: liger runs Triton kernels on a CUDA device"):
        _grads(tiny_model_path, kernels="liger")


def test_an_unknown_kernel_choice_names_the_field(tiny_model_path):
    with pytest.raises(ConfigError, match="training.kernels: 'triton' is not one of none, liger"):
        _grads(tiny_model_path, kernels="triton")


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_fused_ops_give_pytorchs_gradients_on_a_gpu(tiny_model_path):
    """fp32 weights: liger's RMS norm, SwiGLU and rotary Triton kernels against PyTorch's (the plain forward)."""
    plain, plain_metrics, _ = _grads(tiny_model_path, device="cuda")
    fused, metrics, model = _grads(tiny_model_path, device="cuda", kernels="liger")
    assert "Liger" in type(model.model.norm).__name__ or "liger" in type(model.model.layers[0].mlp).__module__
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-5)
    for name, grad in plain.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert float((fused[name] - grad).abs().max() / scale) < 1e-4, name
