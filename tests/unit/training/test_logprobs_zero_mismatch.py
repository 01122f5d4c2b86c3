"""`training.deterministic`'s zero mismatch: the engine's scoring pass (`rescore_groups`) and the trainer's
batch-invariant rows (`LocalBackend(batch_invariant=True)`) give the same logprobs bit for bit (`torch.equal`,
not allclose) for GRPO samples the in-process engine drew, whatever the batch, the token budget or the packing;
so `mismatch/max_abs` is exactly 0 and TIS weighs every token by exactly 1. The controls show what they fix:
the decode pass's own logprobs, and the trainer's micro-batched / packed rows, are off by ~1e-7."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.config.schema import AlgorithmConfig
from tokenmill.engines.local.hf import HFEngine
from tokenmill.health.mismatch import MismatchWatch
from tokenmill.training.batch import collate
from tokenmill.training.local import LocalBackend
from tokenmill.training.logprobs import rescore_groups
from tokenmill.training.update import policy_update
from tokenmill.types import Group, Sample, SamplingParams

TEMPERATURE = 0.8
CHUNK = 64 << 20
PROMPTS = ("12+7=", "3*4=?", "hello there, what is 5+5")


def _grpo_groups(engine: HFEngine, tokenizer) -> list[Group]:
    """One group of 4 samples per prompt, with the decode pass's logprobs (as the generator builds them)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    drawn = engine.generate(prompts, SamplingParams(n=4, max_tokens=12, temperature=TEMPERATURE))
    groups = []
    for g, (prompt, completions) in enumerate(zip(prompts, drawn, strict=True)):
        samples = tuple(
            Sample(tokens=(*prompt, *c.token_ids), loss_mask=(0,) * len(prompt) + (1,) * len(c.token_ids),
                   logprobs=(0.0,) * len(prompt) + c.logprobs, prompt_len=len(prompt), prompt=None,
                   completion="", stop_reason=c.stop_reason, group_id=g, advantage=(-1.0) ** i)
            for i, c in enumerate(completions))
        groups.append(Group(g, samples))
    return groups


@pytest.fixture
def drawn(tiny_model, tokenizer):
    """(the engine, the decode pass's samples, the same samples with the scoring pass's logprobs)."""
    engine = HFEngine(tiny_model, tokenizer, seed=0)
    groups = _grpo_groups(engine, tokenizer)
    scored = rescore_groups(engine.model, groups, temperature=TEMPERATURE, chunk_bytes=CHUNK)
    flat = [s for g in groups for s in g.samples]
    return engine, flat, [s for g in scored for s in g.samples]


def _backend(model, **kwargs) -> LocalBackend:
    return LocalBackend(model, learning_rate=1e-2, total_steps=4, temperature=TEMPERATURE, **kwargs)


def _equal_rows(logprobs_B_T: torch.Tensor, batch, samples: list[Sample]) -> list[bool]:
    """Per row: whether the trainer's logprobs on the trained tokens equal the sample's, bit for bit."""
    out = []
    for row, i in enumerate(batch.sample_index_B.tolist()):
        s = samples[i]
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        mine = logprobs_B_T[row, : len(s.tokens)].detach().cpu()[trained]
        out.append(torch.equal(mine, torch.tensor(s.logprobs, dtype=torch.float32)[trained]))
    return out


LAYOUTS = [(budget, share, rows) for budget in (16, 64, 1 << 20) for share in (False, True) for rows in (1, 5, 12)]


def test_the_scoring_pass_is_what_the_engine_reports_and_differs_from_the_decode_pass(drawn):
    _, decoded, scored = drawn
    assert [s.tokens for s in decoded] == [s.tokens for s in scored]  # the tokens are the decode pass's
    gaps = [abs(a - b) for d, s in zip(decoded, scored, strict=True) for a, b in zip(d.logprobs, s.logprobs)]
    assert 0 < max(gaps) < 1e-5  # a KV-cached decode step reduces in another order than a whole-row forward
    assert all(s.logprobs[: s.prompt_len] == (0.0,) * s.prompt_len for s in scored)


def test_trainer_rows_equal_the_engine_scores_in_every_layout(drawn):
    model, scored = drawn[0].model, drawn[2]
    for budget, share, rows in LAYOUTS:
        backend = _backend(model, micro_batch_tokens=budget, share_prompts=share, batch_invariant=True)
        batch = collate(scored[:rows], [1.0] * rows, pad_id=0)
        assert all(_equal_rows(backend.forward(batch), batch, scored[:rows])), (budget, share, rows)


def test_without_batch_invariance_some_layout_differs(drawn):
    """The control: padded micro-batches and shared-prompt packing change the reduction order."""
    model, scored = drawn[0].model, drawn[2]
    equal = []
    for budget, share, rows in LAYOUTS:
        backend = _backend(model, micro_batch_tokens=budget, share_prompts=share)
        batch = collate(scored[:rows], [1.0] * rows, pad_id=0)
        equal += _equal_rows(backend.forward(batch), batch, scored[:rows])
    assert not all(equal)


def test_the_training_forward_equals_the_engine_scores(drawn):
    """The update's own forward (gradients on, train mode, chunks checkpointed) gives the same bits: with no
    off-policy recomputation the mismatch is read from it."""
    engine, decoded, _ = drawn
    model = engine.model
    small = 1e-4  # MiB: a few positions per chunk of the LM head, so the training forward checkpoints chunks
    regrouped = [Group(0, tuple(decoded))]
    scored = list(rescore_groups(engine.model, regrouped, temperature=TEMPERATURE, chunk_bytes=int(small * 2**20))[0].samples)
    backend = _backend(model, micro_batch_tokens=64, logits_chunk_mib=small, batch_invariant=True)
    batch = collate(scored, [1.0] * len(scored), pad_id=0)
    seen = []

    def loss(logprobs_B_T, micro):
        seen.append(all(_equal_rows(logprobs_B_T, micro, scored)))
        return logprobs_B_T.sum(), {}

    backend.forward_backward(batch, loss)
    assert len(seen) == len(scored) and all(seen)


@pytest.mark.parametrize("off_policy", ["none", "tis", "icepop"])
def test_mismatch_is_exactly_zero_and_importance_weights_exactly_one(drawn, off_policy):
    model, scored = drawn[0].model, drawn[2]
    backend = _backend(model, micro_batch_tokens=64, batch_invariant=True)
    algo = AlgorithmConfig(off_policy=off_policy)
    watch = MismatchWatch(backend)
    metrics = policy_update(scored, backend, algo, pad_id=0, max_tokens=12, rng=random.Random(0), watch=watch)
    assert metrics["mismatch/max_abs"] == 0.0 and metrics["mismatch/kl"] == 0.0
    assert metrics["mismatch/tokens"] == sum(sum(s.loss_mask) for s in scored)
    if off_policy != "none":
        assert metrics["is_weight_mean"] == 1.0
        assert metrics["is_capped_fraction"] == 0.0 and metrics["is_masked_fraction"] == 0.0


def test_the_decode_pass_logprobs_show_a_mismatch(drawn):
    """The control of the one above: the same update on the decode pass's own logprobs."""
    model, decoded = drawn[0].model, drawn[1]
    backend = _backend(model, micro_batch_tokens=64, batch_invariant=True)
    watch = MismatchWatch(backend)
    metrics = policy_update(decoded, backend, AlgorithmConfig(off_policy="tis"), pad_id=0, max_tokens=12,
                            rng=random.Random(0), watch=watch)
    assert metrics["mismatch/max_abs"] > 0.0 and metrics["is_weight_mean"] != 1.0


def test_samples_drawn_by_other_weights_keep_their_decode_logprobs(drawn):
    """An older version's sample, or a partial rollout across an update, was drawn by other weights: their
    logprobs are its behaviour policy's, so the scoring pass of the current weights leaves them alone."""
    engine, decoded, scored = drawn
    across = decoded[1].with_(token_versions=(0,) * (decoded[1].completion_len - 1) + (1,))
    group = Group(0, (decoded[0], across, decoded[2]))
    out = rescore_groups(engine.model, [group], temperature=TEMPERATURE, chunk_bytes=CHUNK, version=0)[0].samples
    assert out[0].logprobs == scored[0].logprobs and out[2].logprobs == scored[2].logprobs
    assert out[1].logprobs == decoded[1].logprobs  # its last token came from version 1
    newer = rescore_groups(engine.model, [group], temperature=TEMPERATURE, chunk_bytes=CHUNK, version=1)[0]
    assert [s.logprobs for s in newer.samples] == [s.logprobs for s in group.samples]
