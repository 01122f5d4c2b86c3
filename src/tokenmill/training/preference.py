"""Offline preference training (DPO / IPO / SimPO) and Bradley-Terry reward-model training.

Both read rows with `prompt`, `chosen` and `rejected` columns (`data.formats.pair_rows` brings every TRL preference
format to these: string completions, the prompt a string or messages). DPO-family losses compare the policy's summed
log-probability of the chosen and the rejected completion (end-of-sequence token included, prompt excluded),
against a frozen copy of the starting policy where the loss needs one; with LoRA that reference is the same
module with its adapters switched off (the base weights never train), so it costs no memory. The reward model is an
`AutoModelForSequenceClassification` (one label) trained on `prompt + completion` text, the exact text
`rewards.ModelReward` scores, so its folder plugs straight into an RL config's `rewards`; with LoRA only the
adapters and the score head train, and the exported folder has them merged.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from tokenmill.algorithms.preference import bradley_terry_loss, dpo_loss, ipo_loss, simpo_loss
from tokenmill.config.offline import PreferenceConfig
from tokenmill.config.schema import LoRAConfig
from tokenmill.data.formats import pair_rows, render_prompt
from tokenmill.tracking.logger import MetricsLogger
from tokenmill.training.batch import collate
from tokenmill.training.logprobs import DEFAULT_CHUNK_MIB, sequence_token_stats
from tokenmill.training.lora import add_lora, is_lora
from tokenmill.training.offline import finish, offline_trainer, optim_settings, run_offline, sampled_batches
from tokenmill.training.sft import sft_sample
from tokenmill.training.sharded import my_share, sum_over_ranks
from tokenmill.training.vision import vision_token_stats
from tokenmill.training.vision_roles import PairImages
from tokenmill.types import ConfigError

PreferenceLoss = Literal["dpo", "ipo", "simpo"]


def pair_logprobs(
    model, tokenizer, rows: Sequence[dict[str, Any]], chunk_bytes: int = DEFAULT_CHUNK_MIB << 20,
    images: PairImages | None = None,
) -> tuple[torch.Tensor, ...]:
    """(chosen logprob sums, rejected logprob sums, chosen lengths, rejected lengths), each `[P]`; the LM head
    runs on chunks of `chunk_bytes` of logits (`training.logprobs`; 0 = the model's full logits). With
    `images` (a vision-language policy's), rows with images are scored with their pictures (`training.vision`)."""
    if images is not None and images.in_rows(rows):
        samples = images.samples(rows)
    else:
        samples = [sft_sample(tokenizer, r["prompt"], r[key]) for key in ("chosen", "rejected") for r in rows]
    batch = collate(samples, [1.0] * len(samples), tokenizer.pad_token_id)
    device = next(model.parameters()).device
    if batch.images_B is not None:
        logprobs_B_T, _ = vision_token_stats(model, batch.to(device), temperature=1.0, chunk_bytes=chunk_bytes)
    else:
        logprobs_B_T, _ = sequence_token_stats(model, batch.input_ids_B_T.to(device), lengths_B=batch.lengths_B,
                                               temperature=1.0, chunk_bytes=chunk_bytes)
    mask_B_T = batch.weights_B_T.to(device)
    in_sample_order = batch.sample_index_B.argsort().to(device)  # collate sorted the rows by length
    sums_B = (logprobs_B_T * mask_B_T).sum(-1)[in_sample_order]
    lengths_B = mask_B_T.sum(-1)[in_sample_order]
    p = len(rows)
    return sums_B[:p], sums_B[p:], lengths_B[:p], lengths_B[p:]


def frozen_reference(model: torch.nn.Module) -> torch.nn.Module | None:
    """The reference DPO / IPO compare against: a frozen copy of a fully trained `model`; None for a LoRA
    model, whose reference is the model itself with its adapters disabled (see `reference_pair_logprobs`)."""
    if is_lora(model):
        return None
    return copy.deepcopy(model).eval().requires_grad_(False)


@torch.no_grad()
def reference_pair_logprobs(model, reference, tokenizer, rows: Sequence[dict[str, Any]],
                            images: PairImages | None = None) -> tuple[torch.Tensor, ...]:
    """`pair_logprobs` of the reference: `reference` if there is one, else `model` (a LoRA model) with its
    adapters disabled, in eval mode like a frozen copy."""
    if reference is not None:
        return pair_logprobs(reference, tokenizer, rows, images=images)
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            return pair_logprobs(model, tokenizer, rows, images=images)
    finally:
        model.train(was_training)


def preference_loss(
    name: PreferenceLoss, policy: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...] | None,
    beta: float, simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    chosen, rejected, chosen_len, rejected_len = policy
    if name == "simpo":
        return simpo_loss(chosen, rejected, chosen_len, rejected_len, beta=beta, gamma=simpo_gamma)
    assert reference is not None
    fn = dpo_loss if name == "dpo" else ipo_loss
    return fn(chosen, rejected, reference[0], reference[1], beta=beta)


# The Python helpers' defaults (a larger learning rate than `PreferenceConfig`'s 2e-5, which `tokenmill preference`
# reads); the other optimiser fields default to `PreferenceConfig`'s (warm-up 10, cosine).
PAIR_DEFAULTS = {"learning_rate": 1e-4}


def run_dpo(
    model, tokenizer, rows, *, steps: int, loss: PreferenceLoss = "dpo", beta: float = 0.1, batch_size: int = 32,
    output_dir: str | Path | None = None, logger: MetricsLogger | None = None, images: PairImages | None = None,
    **optim: Any,
) -> list[float]:
    """Train `model` in place on preference pairs; return the loss of each step. A LoRA model is its own
    reference (adapters disabled); any other is compared with a frozen copy of itself. `images`: how a
    vision-language policy reads the rows' images (TRL's `images` column). `optim`: the optimiser's fields
    (`learning_rate`, `warmup_steps`, `seed`, ... of `OptimConfig`)."""
    reference = frozen_reference(model) if loss != "simpo" else None

    def pair_loss(picked: list[dict[str, Any]], module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ref = None
        if loss != "simpo":
            ref = reference_pair_logprobs(module, reference, tokenizer, picked, images)
        return preference_loss(loss, pair_logprobs(module, tokenizer, picked, images=images), ref, beta)

    return _pairwise_training(model, tokenizer, rows, pair_loss, steps, batch_size, output_dir, logger, optim)


def _pairwise_training(
    model, tokenizer, rows, pair_loss, steps: int, batch_size: int, output_dir: str | Path | None,
    logger: MetricsLogger | None, optim: dict[str, Any],
) -> list[float]:
    """`run_offline` on pairs with `pair_loss(pairs, module) -> (loss tensor, metrics)`, then `LocalBackend.
    optim_step` (grad-norm clip, AdamW, schedule after warm-up); save an HF folder at the end. Under torchrun
    each FSDP2 rank computes its share of the pairs, its loss scaled to its part of the batch mean (the
    gradients are summed over the ranks). A logged row holds the loss, margin, accuracy, lr, grad norm,
    timings and tokens/s."""
    settings = optim_settings(PreferenceConfig, {**PAIR_DEFAULTS, **optim})
    rows = pair_rows(tokenizer, rows)  # any TRL preference format, as prompt / chosen / rejected strings
    backend, module = offline_trainer(model, settings, steps)
    module.train()

    def loss_fn(picked: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
        mine = my_share(picked)
        value, metrics = pair_loss(mine, module)
        value = value * (len(mine) / len(picked))
        value.backward()
        total = sum_over_ranks(float(value.detach()))
        return total, {"loss": total, **metrics}

    losses = run_offline(backend, sampled_batches(rows, batch_size, settings.seed), loss_fn, steps, logger,
                         tokens=lambda picked: _pair_tokens(tokenizer, my_share(picked)), label="pairs",
                         export=lambda: finish(backend, model, tokenizer, output_dir))
    finish(backend, model, tokenizer, output_dir)
    return losses


@torch.no_grad()
def implicit_margin(model, reference, tokenizer, rows, chunk: int = 128,
                    images: PairImages | None = None) -> dict[str, float]:
    """Held-out DPO diagnostics: mean implicit reward margin (pi_c - ref_c) - (pi_r - ref_r) and the share of
    pairs where the policy gives the chosen completion the higher log-probability. `reference` None: a LoRA
    `model` with its adapters disabled."""
    model.eval()
    rows = [rows[i] for i in range(len(rows))]
    margins, ranked = [], []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        c, r, _, _ = pair_logprobs(model, tokenizer, part, images=images)
        rc, rr, _, _ = reference_pair_logprobs(model, reference, tokenizer, part, images)
        margins += ((c - rc) - (r - rr)).tolist()
        ranked += (c > r).tolist()
    return {"margin": sum(margins) / len(margins), "chosen_preferred": sum(ranked) / len(ranked)}


def _rm_scores(model, tokenizer, prompts: list[Any], completions: list[str]) -> torch.Tensor:
    texts = [render_prompt(tokenizer, p) + c for p, c in zip(prompts, completions, strict=True)]
    enc = tokenizer(texts, return_tensors="pt", padding=True).to(next(model.parameters()).device)
    return model(**enc).logits[:, 0].float()


def load_reward_model_for_training(
    path: str | Path, seed: int = 0, lora: LoRAConfig | None = None, device: torch.device | str = "cpu"
):
    """A one-label sequence classifier on top of a causal LM folder (the head starts fresh, seeded). With
    `lora.rank > 0` only the adapters and the head train; `export_model` merges them into a plain folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot load a reward model from {str(path)!r}: {exc}") from None
    tokenizer.padding_side = "right"
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora is not None and lora.rank > 0:
        model = add_lora(model, lora, task_type="SEQ_CLS", field="model.lora")
    return model.to(device), tokenizer


def _pair_tokens(tokenizer, rows: Sequence[dict[str, Any]]) -> int:
    texts = [render_prompt(tokenizer, r["prompt"]) + r[key] for key in ("chosen", "rejected") for r in rows]
    return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def run_reward_model(
    model, tokenizer, rows, *, steps: int, batch_size: int = 32, output_dir: str | Path | None = None,
    logger: MetricsLogger | None = None, **optim: Any,
) -> list[float]:
    """Bradley-Terry training on preference pairs; return the loss of each step. Saves an HF folder that
    `rewards.ModelReward` (an RL config's `rewards: [{path: ...}]`) loads. `optim`: as `run_dpo`'s."""

    def pair_loss(picked: list[dict[str, Any]], module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prompts = [r["prompt"] for r in picked]
        chosen = _rm_scores(module, tokenizer, prompts, [r["chosen"] for r in picked])
        rejected = _rm_scores(module, tokenizer, prompts, [r["rejected"] for r in picked])
        return bradley_terry_loss(chosen, rejected)

    return _pairwise_training(model, tokenizer, rows, pair_loss, steps, batch_size, output_dir, logger, optim)


@torch.no_grad()
def pairwise_accuracy(model, tokenizer, rows, chunk: int = 256) -> float:
    """Share of pairs whose chosen completion the reward model scores higher."""
    model.eval()
    rows = [rows[i] for i in range(len(rows))]
    right = 0
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        prompts = [r["prompt"] for r in part]
        c = _rm_scores(model, tokenizer, prompts, [r["chosen"] for r in part])
        r = _rm_scores(model, tokenizer, prompts, [r["rejected"] for r in part])
        right += int((c > r).sum())
    return right / max(1, len(rows))
