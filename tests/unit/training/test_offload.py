"""`training.optimizer_offload` (tokenmill.training.offload): AdamW stepping on host copies leaves the same
weights as AdamW on the parameters themselves, through a checkpoint's state too."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tokenmill.algorithms.losses import LOSSES
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import collate
from tokenmill.training.local import LocalBackend


def _loss(logprobs_B_T, micro):
    return LOSSES["ppo_clip"](logprobs_B_T, old_logprobs_B_T=micro.old_logprobs_B_T, advantages=micro.advantages,
                              weights_B_T=micro.weights_B_T, clip_low=0.2, clip_high=0.2, ref_logprobs_B_T=None,
                              kl_coef=0.0, kl_estimator="k3")


def _backend(path, offload: bool):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return LocalBackend(model, learning_rate=1e-2, total_steps=10, weight_decay=0.1, warmup_steps=2,
                        lr_schedule="cosine", micro_batch_tokens=64, optimizer_offload=offload)


def _train(backend, steps: range) -> list[dict]:
    out = []
    for step in steps:
        samples = uneven_groups(step, backend.model.config.vocab_size, ((5, 3, 6), (2, 4, 9)))
        backend.forward_backward(collate(samples, [1.0 / len(samples)] * len(samples), pad_id=0), _loss)
        out.append(backend.optim_step())
    return out


def _max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_offloaded_adamw_leaves_the_same_weights(tiny_model_path):
    plain, offloaded = _backend(tiny_model_path, False), _backend(tiny_model_path, True)
    assert offloaded.optimizer_offload and not plain.optimizer_offload
    before = [p.detach().clone() for p in plain.model.parameters()]
    got_plain, got_offloaded = _train(plain, range(5)), _train(offloaded, range(5))
    assert _max_diff(plain, offloaded) < 1e-6
    assert max(float((p - q).abs().max()) for p, q in zip(before, plain.model.parameters(), strict=True)) > 1e-3
    assert [m["lr"] for m in got_plain] == [m["lr"] for m in got_offloaded]
    # the moments live on the host copies, not on the module's parameters
    state = offloaded.optimizer.state
    assert all(p not in state for p in offloaded.model.parameters()) and len(state) == len(offloaded.params)
    assert all(p.grad is None for p in offloaded.model.parameters())


def test_offloaded_state_resumes_to_the_same_weights(tiny_model_path):
    whole = _backend(tiny_model_path, True)
    _train(whole, range(4))
    first = _backend(tiny_model_path, True)
    _train(first, range(2))
    saved = first.state_dict()
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    resumed = _backend(tiny_model_path, True)  # fresh weights: the checkpoint's are loaded, then the state
    resumed.model.load_state_dict(weights)
    resumed.load_state_dict(saved)
    _train(resumed, range(2, 4))
    assert _max_diff(whole, resumed) < 1e-6
