"""`training.deterministic`'s zero mismatch with router replay r3 on a tiny Qwen3-MoE: the engine's scoring
pass (`rescore_groups(..., replay=True)`) routes each sample through the experts its decode pass recorded, as
the trainer's r3 forward does, so the two give the same logprobs bit for bit (`torch.equal`). The control:
the scoring pass routing afresh differs from the trainer's r3 forward wherever the decode pass picked other
experts than a whole-row forward picks. Under bf16 autocast (engine and trainer alike) that happens for some
samples; in fp32 the decode pass and the row agree to ~1e-7, which crosses no router's top-k boundary on this
model, so there routing afresh happens to pick the recorded experts and the numbers agree too."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tokenmill.config.schema import AlgorithmConfig
from tokenmill.engines.local.hf import HFEngine
from tokenmill.health.mismatch import MismatchWatch
from tokenmill.training import LocalBackend, collate
from tokenmill.training.logprobs import rescore_groups
from tokenmill.training.update import policy_update
from tokenmill.types import Group, Sample, SamplingParams, StopReason

CHUNK = 64 << 20


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.testing import build_tiny_moe_model

    path = build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=64, num_layers=2, num_experts=8,
                                top_k=2, expert_size=64)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _drawn(model, tok, autocast) -> list[Sample]:
    """24 samples from an in-process engine on `model` that records its routing (`Sample.routes`)."""
    engine = HFEngine(model, tok, seed=1, autocast_dtype=autocast)
    engine.record_routing(True)
    prompts = [[5 + i, 6 + i, 7, 8 + i, 9] for i in range(6)]
    out = engine.generate(prompts, SamplingParams(n=4, max_tokens=20, temperature=1.0))
    return [Sample(tokens=(*p, *c.token_ids), loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                   logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="p", completion="c",
                   stop_reason=StopReason.STOP, routes=c.routes, advantage=(-1.0) ** i)
            for p, group in zip(prompts, out, strict=True) for i, c in enumerate(group)]


def _scored(model, samples, autocast, replay: bool) -> list[Sample]:
    return list(rescore_groups(model, [Group(0, tuple(samples))], temperature=1.0, chunk_bytes=CHUNK,
                               autocast_dtype=autocast, replay=replay)[0].samples)


def _r3(model, autocast) -> LocalBackend:
    return LocalBackend(model, learning_rate=1e-2, total_steps=2, router_replay="r3", batch_invariant=True,
                        autocast_dtype=autocast, micro_batch_tokens=64)


def _equal_rows(model, samples, autocast) -> list[bool]:
    """Per sample: whether the trainer's r3 forward gives its logprobs on the trained tokens, bit for bit."""
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    logprobs_B_T = _r3(model, autocast).forward(batch)
    out = []
    for row, i in enumerate(batch.sample_index_B.tolist()):
        s = samples[i]
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        out.append(torch.equal(logprobs_B_T[row, : len(s.tokens)][trained], torch.tensor(s.logprobs)[trained]))
    return out


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_replayed_scoring_pass_equals_the_trainer_r3_forward(moe, autocast):
    model, tok = moe
    samples = _drawn(model, tok, autocast)
    assert all(s.routes is not None and len(s.routes) == len(s.tokens) for s in samples)
    assert all(_equal_rows(model, _scored(model, samples, autocast, replay=True), autocast))


def test_routing_afresh_differs_from_the_trainer_r3_forward_in_bf16(moe):
    """The control: in bf16 the decode pass sent some tokens to other experts than the whole row picks."""
    model, tok = moe
    samples = _drawn(model, tok, torch.bfloat16)
    equal = _equal_rows(model, _scored(model, samples, torch.bfloat16, replay=False), torch.bfloat16)
    assert 0 < equal.count(False) < len(equal)
    # in fp32 (the scoring pass ~1e-7 from the decode pass) the same experts win: routing afresh agrees
    fp32 = _drawn(model, tok, None)
    assert all(_equal_rows(model, _scored(model, fp32, None, replay=False), None))


def test_an_r3_update_reads_exactly_zero_mismatch(moe):
    """The update's own forwards (the off-policy recomputation, then gradients on) replay the same routes."""
    model, tok = copy.deepcopy(moe[0]), moe[1]  # the update moves the weights: the other tests keep theirs
    scored = _scored(model, _drawn(model, tok, torch.bfloat16), torch.bfloat16, replay=True)
    backend = _r3(model, torch.bfloat16)
    metrics = policy_update(scored, backend, AlgorithmConfig(off_policy="tis"), pad_id=0, max_tokens=20,
                            rng=random.Random(0), watch=MismatchWatch(backend))
    assert metrics["mismatch/max_abs"] == 0.0 and metrics["mismatch/kl"] == 0.0
    assert metrics["is_weight_mean"] == 1.0 and metrics["mismatch/tokens"] > 0
