"""Trainer options that change how the policy's forward runs, not what it computes: activation checkpointing
(`training.activation_checkpointing`) and liger-kernel's fused Triton ops (`training.kernels: liger`).

    apply_trainer_kernels(model, activation_checkpointing=True, kernels="liger")

Both keep the numbers: checkpointing recomputes each layer's activations in the backward (same gradients),
liger's RMS norm, SwiGLU and rotary kernels compute the same functions fused (within bf16 rounding). Both run
through transformers' forward, so the fast forward (`training.logprobs.fast_forward`) steps aside.
"""

from __future__ import annotations

import importlib.util

import torch

from tokenmill.types import ConfigError

KERNEL_CHOICES = ("none", "liger")


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn transformers' gradient checkpointing on (non-reentrant: LoRA's frozen inputs need no grad) or off."""
    base = _base(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        if enabled:
            raise ConfigError(f"training.activation_checkpointing: {type(base).__name__} does not support "
                              "gradient checkpointing")
        return
    new = hasattr(base, "activation_checkpointing_enable")  # transformers >= 5.x renames the gradient_ methods
    if enabled:
        kwargs = {"use_reentrant": False}
        if new:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif getattr(base, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False):
        (base.activation_checkpointing_disable if new else base.gradient_checkpointing_disable)()


def apply_liger(model: torch.nn.Module) -> None:
    """Patch the policy's RMS norms, SwiGLU MLPs and rotary embedding with liger-kernel's Triton ops (its
    cross-entropy stays off: tokenmill's chunked logprobs never build the logits a loss would take)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("training.kernels: liger needs liger-kernel: pip install tokenmill[kernels]")
    device = next(model.parameters()).device
    if device.type != "cuda":  # checked before the import: Triton needs no driver to be refused
        raise ConfigError(f"training.kernels: liger runs Triton kernels on a CUDA device, and the policy is on "
                          f"{device.type}; use training.kernels: none")
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except Exception as exc:  # noqa: BLE001 - a Triton or transformers version it does not know: one line
        raise ConfigError(f"training.kernels: liger-kernel did not import ({type(exc).__name__}: {exc})") from None
    _apply_liger_kernel_to_instance(model=_base(model), rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def apply_trainer_kernels(model: torch.nn.Module, *, activation_checkpointing: bool = False,
                          kernels: str = "none") -> None:
    """Apply `training.activation_checkpointing` and `training.kernels` to the policy module. Both live in
    transformers' forward: the fused decoder forward steps aside for a checkpointed decoder by itself, and is
    turned off for a liger-patched one (it calls the projections itself, which would bypass the kernels)."""
    from tokenmill.training.logprobs import set_fast_forward

    if kernels not in KERNEL_CHOICES:
        raise ConfigError(f"training.kernels: {kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
    set_activation_checkpointing(model, activation_checkpointing)
    if kernels == "liger":
        apply_liger(model)
        set_fast_forward(model, False)
