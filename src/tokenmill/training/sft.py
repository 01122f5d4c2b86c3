"""Supervised fine-tuning: on (prompt, completion) rows (the warm start before RL), on chat conversations
with the loss on assistant tokens only, or on plain text: TRL's SFT formats (`data.formats`).

It reuses the RL machinery: samples whose loss mask covers what the model should say (the completion and its
end-of-sequence token, or every assistant message as `data.chat` locates it), token-mean weights, the same
backend and the registered `sft` loss. With `packing`, the sequences of a batch are packed side by side
into rows of up to `micro_batch_tokens` tokens (block-diagonal attention, positions restarting per sequence),
so short conversations waste no compute on padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmill.algorithms.aggregation import token_weights
from tokenmill.algorithms.losses import sft_loss
from tokenmill.config.offline import SFTConfig
from tokenmill.data.chat import chat_tokens
from tokenmill.data.formats import SFT_FORMATS, is_conversation
from tokenmill.rollout.generator import encode_prompt
from tokenmill.tracking.logger import MetricsLogger
from tokenmill.training.batch import Batch, collate
from tokenmill.training.offline import finish, offline_trainer, optim_settings, run_offline, sampled_batches
from tokenmill.types import ConfigError, Sample, StopReason


def sft_sample(tokenizer, prompt: Any, completion: str) -> Sample:
    prompt_ids = encode_prompt(tokenizer, prompt)
    target = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return Sample(
        tokens=tuple(prompt_ids + target),
        loss_mask=(0,) * len(prompt_ids) + (1,) * len(target),
        logprobs=(0.0,) * (len(prompt_ids) + len(target)),
        prompt_len=len(prompt_ids),
        prompt=prompt,
        completion=completion,
        stop_reason=StopReason.STOP,
    )


def text_sample(tokenizer, text: str) -> Sample:
    """Plain text (TRL's language-modeling `text`): every token trained but the first (nothing predicts it;
    the tokenizer's BOS where it adds one), then end-of-sequence."""
    ids = list(tokenizer(text)["input_ids"]) + [tokenizer.eos_token_id]
    return Sample(tokens=tuple(ids), loss_mask=(0,) + (1,) * (len(ids) - 1), logprobs=(0.0,) * len(ids),
                  prompt_len=1, prompt=tokenizer.decode(ids[:1]), completion=text, stop_reason=StopReason.STOP)


def chat_sample(tokenizer, messages: list[dict[str, Any]], tools=None, first: int = 0) -> Sample:
    """A conversation as a `Sample` whose loss mask covers the assistant messages only (from message `first`
    on: a conversational prompt-completion row trains its completion)."""
    ids, mask = chat_tokens(tokenizer, messages, tools=tools, first=first)
    start = mask.index(1) if 1 in mask else len(ids)
    return Sample(
        tokens=tuple(ids), loss_mask=tuple(mask), logprobs=(0.0,) * len(ids), prompt_len=start,
        prompt=messages[: max(1, first)], completion=tokenizer.decode(ids[start:]), stop_reason=StopReason.STOP,
    )


def _pair_sample(tokenizer, i: int, prompt: Any, completion: Any, columns: tuple[str, str]) -> Sample:
    """A prompt-completion row, standard or conversational (TRL's formats), as a sample; a value of neither
    format is a `ConfigError` naming the row and the column."""
    for column, value in zip(columns, (prompt, completion), strict=True):
        if not (isinstance(value, str) or is_conversation(value)):
            raise ConfigError(f"{column}: row {i} holds {type(value).__name__}; SFT takes {', '.join(SFT_FORMATS)}")
    if is_conversation(completion):
        if not is_conversation(prompt):
            raise ConfigError(f"{columns[1]}: row {i}: a conversational completion needs a conversational prompt "
                              f"(a list of messages), got {type(prompt).__name__}")
        return chat_sample(tokenizer, list(prompt) + list(completion), first=len(prompt))
    return sft_sample(tokenizer, prompt, completion)  # a string completion after a string or chat prompt


def sft_samples(tokenizer, rows, prompt_column: str = "prompt", completion_column: str = "completion",
                messages_column: str | None = None, text_column: str | None = None) -> list[Sample]:
    """The rows as samples: conversations (OpenAI-style message lists in `messages_column`) trained on their
    assistant tokens only, plain text (`text_column`) trained whole, or (prompt, completion) pairs, each
    side a string or messages. Rows with no token to train on are left out."""
    if messages_column is not None:
        samples = [chat_sample(tokenizer, r[messages_column]) for r in rows]
    elif text_column is not None:
        samples = [text_sample(tokenizer, r[text_column]) for r in rows]
    else:
        columns = ("data.prompt_column", "completion_column")
        samples = [_pair_sample(tokenizer, i, r[prompt_column], r[completion_column], columns)
                   for i, r in enumerate(rows)]
    samples = [s for s in samples if any(s.loss_mask)]
    if not samples:
        raise ValueError("no row has a token to train on (no assistant message / empty completions)")
    return samples


def _loss(logprobs_B_T: torch.Tensor, batch: Batch):
    return sft_loss(logprobs_B_T, weights_B_T=batch.weights_B_T)


def run_sft(
    model,
    tokenizer,
    rows,
    *,
    steps: int,
    batch_size: int = 64,
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str | None = None,
    text_column: str | None = None,
    packing: bool = False,
    micro_batch_tokens: int = 8192,
    output_dir: str | Path | None = None,
    log_every: int = 0,
    logger: MetricsLogger | None = None,
    samples: list[Sample] | None = None,
    **optim: Any,
) -> list[float]:
    """Train `model` in place for `steps` optimiser steps; return the loss (token NLL) of each step. `optim`:
    the optimiser's fields (`learning_rate`, `warmup_steps`, `seed`, ... of `OptimConfig`), `SFTConfig`'s
    defaults for the others. With `messages_column`, rows are conversations (OpenAI-style message lists)
    trained on assistant tokens only; with `text_column`, plain text trained whole. With a `logger`, each step
    writes the same metrics row as an RL step (loss, lr, grad norm, timings, tokens/s); without one, a line
    every `log_every` steps. `samples`: ready-made ones in place of `rows` (e.g. with images:
    `training.vision.image_sft_samples`)."""
    settings = optim_settings(SFTConfig, optim)
    if samples is None:
        samples = sft_samples(tokenizer, rows, prompt_column, completion_column, messages_column, text_column)
    # under torchrun: FSDP2 ranks, each training its share of every batch (`model` is refreshed at the end)
    backend, _ = offline_trainer(model, settings, steps, micro_batch_tokens=micro_batch_tokens,
                                 share_prompts=not packing, pack_sequences=packing)

    def loss_fn(picked: list[Sample]) -> tuple[float, dict[str, Any]]:
        weights = token_weights([sum(s.loss_mask) for s in picked], "token_mean")
        metrics = backend.forward_backward(collate(picked, weights, tokenizer.pad_token_id), _loss)
        return metrics["nll"], metrics

    losses = run_offline(backend, sampled_batches(samples, batch_size, settings.seed), loss_fn, steps, logger,
                         tokens=lambda picked: sum(len(s.tokens) for s in picked), log_every=log_every, label="sft",
                         export=lambda: finish(backend, model, tokenizer, output_dir))
    finish(backend, model, tokenizer, output_dir)
    return losses
