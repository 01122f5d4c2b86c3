"""Attention by segments (`training.segment_attention`) against the dense [rows, L, L] mask: the same
logprobs, entropies and gradients for shared-prompt rows and for whole sequences packed side by side, and
no 4-D mask handed to the model."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tokenmill.training import collate
from tokenmill.training.packing import micro_packs, packed_inputs, packed_token_stats, sequence_segments
from tokenmill.training.segment_attention import SegmentIndex, segmented_attention
from tokenmill.types import Sample, StopReason

DENSE, SEGMENTS = 10**9, 0  # min_width: never / always attend by segments


def _model():
    torch.manual_seed(0)  # 4 query heads on 2 key/value heads
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _samples(shared: bool, seed: int = 0) -> list[Sample]:
    """Groups of 2-4 completions (1-9 tokens) after prompts of 2-6 tokens (no prompt: whole sequences)."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        prompt = [rng.randint(3, 60) for _ in range(rng.randint(2, 6))]
        for _ in range(rng.randint(2, 4)):
            completion = [rng.randint(3, 60) for _ in range(rng.randint(1, 9))]
            p = len(prompt) if shared else 0
            tokens = prompt + completion
            out.append(Sample(tokens=tuple(tokens), loss_mask=(0,) * len(prompt) + (1,) * len(completion),
                              logprobs=(0.0,) * len(tokens), prompt_len=p or 1, prompt="p", completion="c",
                              stop_reason=StopReason.STOP, advantage=rng.uniform(-1, 1)))
    return out


def _stats(model, shared: bool, min_width: int):
    model.zero_grad()
    samples = _samples(shared)
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    segments = None if shared else sequence_segments(batch)
    total, outs = 0.0, []
    for micro, packed in micro_packs(batch, 64, segments):
        lp, ent = packed_token_stats(model, packed, tuple(micro.input_ids_B_T.shape), temperature=0.8, entropy=True,
                                     entropy_grad=True, min_width=min_width)
        total = total + (lp * micro.advantages_B[:, None]).sum() + 0.1 * ent.sum()
        outs.append((lp.detach(), ent.detach()))
    total.backward()
    return outs, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shared", [True, False])
def test_same_logprobs_entropies_and_gradients_as_the_dense_mask(shared):
    model = _model()
    dense_out, dense_grads = _stats(model, shared, DENSE)
    seg_out, seg_grads = _stats(model, shared, SEGMENTS)
    assert len(dense_out) > 1  # several packed micro-batches
    for (lp_d, ent_d), (lp_s, ent_s) in zip(dense_out, seg_out, strict=True):
        assert torch.allclose(lp_d, lp_s, atol=1e-5) and torch.allclose(ent_d, ent_s, atol=1e-5)
        assert lp_d.abs().sum() > 0
    worst = max(float((dense_grads[n] - seg_grads[n]).abs().max()) for n in dense_grads)
    assert worst < 1e-5, f"largest gradient difference {worst:.2e}"


def test_no_dense_mask_reaches_the_model():
    model = _model()
    samples = _samples(True)
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    _, packed = next(micro_packs(batch, 10_000))
    width = packed.input_ids_R_L.shape[1]
    inputs = packed_inputs(packed, model, torch.float32, torch.device("cpu"), min_width=0)
    assert inputs["attention_mask"].shape == (packed.input_ids_R_L.shape[0], width)  # 2-D, all ones
    assert isinstance(inputs["segments"], SegmentIndex)
    dense = packed_inputs(packed, model, torch.float32, torch.device("cpu"), min_width=width + 1)
    assert dense["attention_mask"].dim() == 4 and "segments" not in dense
    model.config._attn_implementation = "eager"  # no wrapper on that path: the dense mask, whatever the width
    assert "segments" not in packed_inputs(packed, model, torch.float32, torch.device("cpu"), min_width=0)
    model.config._attn_implementation = "sdpa"
    model.config.sliding_window, model.config.use_sliding_window = 4, True  # a window the segments would ignore
    assert "segments" not in packed_inputs(packed, model, torch.float32, torch.device("cpu"), min_width=0)


def test_segmented_attention_by_hand():
    """One row: prompt of 2, completions of 2 and 1 at columns 2 and 4, a pad at column 5."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    index = SegmentIndex.build([(2, [(2, 2), (4, 1)])], width=6)
    out = segmented_attention(q, k, v, index)  # [1, 6, 2, 4]

    def attend(i, keys):
        w = torch.softmax(q[0, :, i : i + 1] @ k[0, :, keys].transpose(-1, -2) / 2.0, dim=-1)  # 1/sqrt(4)
        return (w @ v[0, :, keys])[:, 0]

    expected = [attend(0, [0]), attend(1, [0, 1]), attend(2, [0, 1, 2]), attend(3, [0, 1, 2, 3]),
                attend(4, [0, 1, 4]), torch.zeros(2, 4)]
    for i, e in enumerate(expected):
        assert torch.allclose(out[0, i], e, atol=1e-6), i
