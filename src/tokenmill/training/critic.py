"""PPO's critic: a value model trained beside the policy, and the GAE step that turns its values into
per-token advantages.

The critic is a one-label `AutoModelForTokenClassification` (the policy's transformer with a scalar head
instead of the vocabulary head), so it saves and loads as a plain HF folder. Its value at position t is read
from the hidden state *before* token t, which aligns values with `token_logprobs`: `V_t` is the value of the
state in which the policy chose token t.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tokenmill.algorithms.value import explained_variance, gae, token_rewards, value_loss, whiten
from tokenmill.config.schema import AlgorithmConfig, CriticConfig
from tokenmill.training.batch import Batch, collate
from tokenmill.training.local import LocalBackend, packing_segments
from tokenmill.training.lora import add_lora
from tokenmill.training.packing import PackedRows, micro_packs, packed_inputs
from tokenmill.types import ConfigError, Sample


def load_critic(cfg: CriticConfig, policy_path: str, device: torch.device, *,
                freeze_vision: bool = True) -> torch.nn.Module:
    """The critic's model: `cfg.path`, or the policy's weights with a zeroed value head (every value starts at
    0, so the first advantages are plain returns and the critic learns from there). With `cfg.lora.rank > 0`
    only LoRA adapters and the head train (peft). A vision-language model's critic sees the images
    (`training.vision_roles.VisionValueModel`, its vision tower frozen unless `freeze_vision` is false)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    from tokenmill.engines.local.vision import is_vision_config

    path = cfg.path or policy_path
    try:
        vision = is_vision_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError):
        vision = False  # the loader below names the field
    if vision:
        from tokenmill.training.vision_roles import load_vision_critic

        return load_vision_critic(path, cfg, freeze_vision).to(device)
    quiet = cfg.path is None  # the value head is missing from a policy folder by design: no warning about it
    level = hf_logging.get_verbosity()
    try:
        if quiet:
            hf_logging.set_verbosity_error()
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        field = "critic.path" if cfg.path else "model.path"
        raise ConfigError(f"{field}: cannot load a value model from {path!r}: {exc}") from None
    finally:
        hf_logging.set_verbosity(level)
    if cfg.path is None:
        with torch.no_grad():
            for p in model.score.parameters():
                p.zero_()
    for module in model.modules():  # a token-classification head brings dropout (0.1 by default): values must
        if isinstance(module, torch.nn.Dropout):  # not be noisy while training nor differ from the no-grad pass
            module.p = 0.0
    if cfg.lora.rank > 0:  # adapters + the value head train; the head's trained copy starts from the zeroed one
        model = add_lora(model, cfg.lora, task_type="TOKEN_CLS", field="critic.lora")
    return model.to(device)


class Critic:
    """The value model and its optimiser (a `LocalBackend`, so schedule, clipping and state are shared)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        total_steps: int,
        value_clip: float | None = 0.2,
        max_grad_norm: float = 1.0,
        micro_batch_tokens: int = 8192,
        autocast_dtype: torch.dtype | None = None,
        share_prompts: bool = True,
    ) -> None:
        self.model = model
        self.value_clip = value_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.share_prompts = share_prompts
        self.autocast_dtype = autocast_dtype
        self.optim = LocalBackend(
            model, learning_rate=learning_rate, total_steps=total_steps, max_grad_norm=max_grad_norm,
            micro_batch_tokens=micro_batch_tokens, track_entropy=False, autocast_dtype=autocast_dtype,
        )

    def _values(self, micro: Batch) -> torch.Tensor:
        if micro.images_B is not None:  # a vision-language critic reads the rows' images as the policy does
            from tokenmill.training.vision_roles import image_values

            return image_values(self.model, micro, self.autocast_dtype)
        device = next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out_B_T = self.model(input_ids=micro.input_ids_B_T).logits[..., 0].float()
        return torch.nn.functional.pad(out_B_T[:, :-1], (1, 0))

    def _packed_values(self, micro: Batch, packed: PackedRows) -> torch.Tensor:
        """Values of the completion tokens of shared-prompt packed rows (`training.packing`), scattered into
        `[B, T]` (0 at prompt tokens, which no loss or advantage reads). Rows with images are packed with their
        pictures as the policy's (`training.vision_roles.packed_image_values`); where they cannot be
        (`training.vision.packed_pictures`), the micro-batch runs as padded rows."""
        device = next(self.model.parameters()).device
        if micro.images_B is not None:
            from tokenmill.training.vision_roles import packed_image_values

            out_R_L = packed_image_values(self.model, micro, packed, self.autocast_dtype)
            if out_R_L is None:
                return self._values(micro)
        else:
            dtype = next(self.model.parameters()).dtype
            inputs = packed_inputs(packed, self.model, self.autocast_dtype or dtype, device)
            with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                out_R_L = self.model(**inputs).logits[..., 0].float()
        v_K = out_R_L[packed.src_row_K.to(device), packed.src_pos_K.to(device)]  # read before the token
        dst = (packed.dst_b_K.to(device), packed.dst_t_K.to(device))
        out_shape = tuple(micro.input_ids_B_T.shape)
        return torch.zeros(out_shape, dtype=torch.float32, device=device).index_put(dst, v_K)

    def _micro_values(self, batch: Batch) -> Iterator[tuple[torch.Tensor, Batch, torch.Tensor]]:
        """Per micro-batch of at most `micro_batch_tokens`: (its rows in `batch`, the micro-batch on the device,
        its values). Groups sharing a prompt (and, with images, its pictures) are packed like the policy's (the
        prompt runs once: `training.packing`, `training.vision`); with `share_prompts` false, length-bucketed
        padded rows."""
        device = next(self.model.parameters()).device
        segments = packing_segments(batch, share_prompts=self.share_prompts, pack_sequences=False)
        if segments is not None:
            for micro, packed in micro_packs(batch, self.micro_batch_tokens, segments):
                micro = micro.to(device)
                yield packed.batch_rows, micro, self._packed_values(micro, packed)
            return
        start = 0
        for micro in batch.micro_batches(self.micro_batch_tokens):
            micro = micro.to(device)
            yield torch.arange(start, start + micro.size), micro, self._values(micro)
            start += micro.size

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """`V_t` for every token of `batch` (on the CPU, aligned with it), micro-batched (0 at the prompt tokens
        of packed groups)."""
        self.model.eval()
        out = torch.zeros_like(batch.old_logprobs_B_T)
        for rows, _, v in self._micro_values(batch):
            out[rows, : v.shape[1]] = v.cpu()
        return out

    def forward_backward(self, batch: Batch) -> dict[str, float]:
        """Accumulate the (clipped) value-loss gradient over the micro-batches; return summed metrics."""
        self.model.train()
        totals: dict[str, float] = {}
        for _, micro, values_B_T in self._micro_values(batch):
            loss, metrics = value_loss(
                values_B_T, micro.old_values_B_T, micro.returns_B_T, micro.weights_B_T, self.value_clip
            )
            loss.backward()
            metrics["value_loss"] = loss.detach()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return totals

    def optim_step(self) -> dict[str, float]:
        return self.optim.optim_step()

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.model.state_dict(), "optimizer": self.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["weights"])
        self.optim.load_state_dict(state["optimizer"])


def gae_advantages(
    samples: Sequence[Sample],
    critic: Critic,
    algo: AlgorithmConfig,
    *,
    pad_id: int,
    reference=None,
) -> tuple[list[Sample], dict[str, float]]:
    """Score every policy token with the critic and run GAE over each trajectory; return the samples with
    `token_advantages`, `returns` and `values` set (whitened over the batch if asked) and the step's critic
    metrics. With `algo.kl_in_reward` the reference's logprobs put a per-token KL penalty into the rewards."""
    batch = collate(samples, [1.0] * len(samples), pad_id)  # weights = the loss mask
    mask_B_T = batch.weights_B_T > 0
    values_B_T = critic.values(batch) * mask_B_T
    order = batch.sample_index_B.tolist()
    scores_B = torch.tensor([samples[i].reward for i in order], dtype=torch.float32)
    ref_B_T = reference.forward(batch) if reference is not None and algo.kl_in_reward else None
    kl_coef = algo.kl_coef if algo.kl_in_reward else 0.0
    rewards_B_T = token_rewards(scores_B, mask_B_T, batch.old_logprobs_B_T, ref_B_T, kl_coef)
    adv_B_T, returns_B_T = gae(rewards_B_T, values_B_T, mask_B_T, gamma=algo.gamma, lam=algo.lam)
    if algo.whiten_advantages:
        adv_B_T = whiten(adv_B_T, mask_B_T)
    n_tokens = max(1.0, float(mask_B_T.sum()))
    metrics = {
        "critic/value_mean": float(values_B_T.sum()) / n_tokens,
        "critic/return_mean": float(returns_B_T.sum()) / n_tokens,
        "critic/explained_variance": explained_variance(values_B_T, returns_B_T, mask_B_T),
    }
    if ref_B_T is not None:
        metrics["kl"] = float(((batch.old_logprobs_B_T - ref_B_T) * mask_B_T).sum()) / n_tokens
    out = list(samples)
    for b, i in enumerate(order):
        n = len(samples[i].tokens)
        adv = tuple(adv_B_T[b, :n].tolist())
        out[i] = samples[i].with_(
            token_advantages=adv, returns=tuple(returns_B_T[b, :n].tolist()),
            values=tuple(values_B_T[b, :n].tolist()), advantage=sum(adv) / max(1, sum(samples[i].loss_mask)),
        )
    return out, metrics
