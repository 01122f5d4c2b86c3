"""Supervised fine-tuning: on (prompt, completion) rows (the warm start before RL) or on chat conversations
with the loss on assistant tokens only.

It reuses the RL machinery: samples whose loss mask covers what the model should say (the completion and its
end-of-sequence token, or every assistant message as `data.chat` locates it), token-mean weights, the same
backend and the registered `sft` loss. With `packing`, the sequences of a batch are packed side by side
into rows of up to `micro_batch_tokens` tokens (block-diagonal attention, positions restarting per sequence),
so short conversations waste no compute on padding.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from tokenmill.algorithms.aggregation import token_weights
from tokenmill.algorithms.losses import sft_loss
from tokenmill.checkpoint.export import export_model
from tokenmill.data.chat import chat_tokens
from tokenmill.rollout.generator import encode_prompt
from tokenmill.tracking.logger import MetricsLogger, offline_row
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.training.batch import Batch, collate
from tokenmill.training.dist import is_main
from tokenmill.training.sharded import copy_back, offline_backend
from tokenmill.types import Sample, StopReason


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


def chat_sample(tokenizer, messages: list[dict[str, Any]], tools=None) -> Sample:
    """A conversation as a `Sample` whose loss mask covers the assistant messages only."""
    ids, mask = chat_tokens(tokenizer, messages, tools=tools)
    first = mask.index(1) if 1 in mask else len(ids)
    return Sample(
        tokens=tuple(ids), loss_mask=tuple(mask), logprobs=(0.0,) * len(ids), prompt_len=first,
        prompt=messages[:1], completion=tokenizer.decode(ids[first:]), stop_reason=StopReason.STOP,
    )


def _loss(logprobs_B_T: torch.Tensor, batch: Batch):
    return sft_loss(logprobs_B_T, weights_B_T=batch.weights_B_T)


def run_sft(
    model,
    tokenizer,
    rows,
    *,
    steps: int,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int = 20,
    seed: int = 0,
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str | None = None,
    packing: bool = False,
    micro_batch_tokens: int = 8192,
    output_dir: str | Path | None = None,
    log_every: int = 0,
    logger: MetricsLogger | None = None,
) -> list[float]:
    """Train `model` in place for `steps` optimiser steps; return the loss of each step. With
    `messages_column`, rows are conversations (OpenAI-style message lists) trained on assistant tokens only.
    With a `logger`, each step writes the same metrics row as an RL step (loss, lr, grad norm, timings,
    tokens/s); without one, a line every `log_every` steps."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if messages_column is not None:
        samples = [chat_sample(tokenizer, r[messages_column]) for r in rows]
    else:
        samples = [sft_sample(tokenizer, r[prompt_column], r[completion_column]) for r in rows]
    samples = [s for s in samples if any(s.loss_mask)]
    if not samples:
        raise ValueError("no row has a token to train on (no assistant message / empty completions)")
    # under torchrun: FSDP2 ranks, each training its share of every batch (`model` is refreshed at the end)
    backend, _ = offline_backend(
        model, learning_rate=learning_rate, total_steps=steps, warmup_steps=warmup_steps,
        lr_schedule="cosine", track_entropy=False, micro_batch_tokens=micro_batch_tokens,
        share_prompts=not packing, pack_sequences=packing,
    )
    losses = []
    for step in range(1, steps + 1):
        picked = rng.sample(samples, min(batch_size, len(samples)))
        weights = token_weights([sum(s.loss_mask) for s in picked], "token_mean")
        with step_timer(step) as timer, stage("train", tokens=sum(len(s.tokens) for s in picked)):
            metrics = backend.forward_backward(collate(picked, weights, tokenizer.pad_token_id), _loss)
            metrics |= backend.optim_step()
        losses.append(metrics["nll"])
        if logger is not None:
            logger.log(step, offline_row(metrics, timer))
        elif log_every and step % log_every == 0 and is_main():
            print(f"sft step {step}/{steps} nll {metrics['nll']:.4f}", flush=True)
    copy_back(backend, model)
    if output_dir is not None and is_main():
        export_model(model, tokenizer, Path(output_dir))
    return losses
