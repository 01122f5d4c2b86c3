"""FSDP2 (`ShardedBackend`) on 2 CPU ranks (gloo, file rendezvous: no ports) trains exactly like `LocalBackend`
on the same global batch, and a sharded checkpoint resumes exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tokenmill.algorithms import token_weights
from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import LocalBackend, collate
from tokenmill.training.local import ReferenceModel, micro_token_stats
from tokenmill.training.sharded import micro_batch_count, rank_rows
from tokenmill.training.update import _batch_loss, policy_update, value_update
from tokenmill.types import Sample

STEPS, SAVE_AT = 5, 3
KWARGS = {"learning_rate": 1e-3, "total_steps": STEPS * 2, "micro_batch_tokens": 40, "warmup_steps": 1,
          "lr_schedule": "cosine", "max_grad_norm": 0.2}
ALGO = AlgorithmConfig(mini_batches=2, off_policy="tis")  # tis: the update also runs the no-grad forward


def _samples(step: int, vocab: int) -> list[Sample]:
    """One long group of 6 (prompt 8, answers up to 12 tokens) and four short groups of 2: whole groups
    per rank give one rank many more tokens and micro-batches than the other."""
    return uneven_groups(step, vocab, ((8, 6, 12), (2, 2, 3), (3, 2, 3), (2, 2, 2), (4, 2, 3)))


def _train(backend, vocab: int, steps: range) -> list[dict[str, float]]:
    return [
        policy_update(_samples(s, vocab), backend, ALGO, pad_id=0, max_tokens=12, rng=random.Random(s))
        for s in steps
    ]


def _model(path: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _critic_model(path: str):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)  # the value head is new: the same draw on every rank and in the reference
    # no dropout before the head: its random masks differ with the split, so the sums could not be compared
    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.dropout.p = 0.0
    return model


def _critic_samples(step: int, vocab: int) -> list[Sample]:
    rng = random.Random(200 + step)
    out = []
    for s in _samples(step, vocab):
        per_token = [tuple(rng.uniform(-1, 1) * m for m in s.loss_mask) for _ in range(3)]
        out.append(s.with_(token_advantages=per_token[0], returns=per_token[1], values=per_token[2]))
    return out


def _critic_train(critic, vocab: int, steps: range) -> list[dict[str, float]]:
    return [value_update(_critic_samples(s, vocab), critic, ALGO, pad_id=0, rng=random.Random(s)) for s in steps]


def _critic_weights(critic) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in critic.model.named_parameters()}


def _critic_run(tmp_path: Path, model_path: str, vocab: int) -> dict:
    from tokenmill.training.sharded import ShardedCritic

    kwargs = {"learning_rate": 1e-3, "total_steps": 10, "micro_batch_tokens": 40}
    critic = ShardedCritic(_critic_model(model_path), checkpoint_dir=tmp_path / "shards", **kwargs)
    out = {"values": critic.values(collate(_critic_samples(9, vocab), [1.0] * 14, pad_id=0))}
    out["metrics"] = _critic_train(critic, vocab, range(2))
    state = critic.state_dict()
    out["metrics"] += _critic_train(critic, vocab, range(2, 3))
    out["weights"] = _critic_weights(critic)
    resumed = ShardedCritic(_critic_model(model_path), checkpoint_dir=tmp_path / "shards", **kwargs)
    resumed.load_state_dict(state)
    out["resumed_metrics"] = _critic_train(resumed, vocab, range(2, 3))
    out["resumed_weights"] = _critic_weights(resumed)
    return out


def _worker(rank: int, world: int, tmp: str, model_path: str) -> None:
    import torch.distributed as dist

    from tokenmill.training.dist import init_distributed
    from tokenmill.training.sharded import ShardedBackend, ShardedReference

    torch.set_num_threads(1)
    init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=120)
    tmp_path = Path(tmp)
    backend = ShardedBackend(_model(model_path), checkpoint_dir=tmp_path / "shards", **KWARGS)
    vocab = backend.model.config.vocab_size
    out: dict = {"local_rows": [], "counts": []}
    for s in range(STEPS):  # the uneven split this test relies on, recorded per step
        batch = collate(_samples(s, vocab), [1.0] * 14, pad_id=0)
        mine = batch.select(rank_rows(batch, world)[rank])
        out["local_rows"].append(mine.num_tokens)
        out["counts"].append(micro_batch_count(mine, 40, share_prompts=True, pack_sequences=False))
    probe = collate(_samples(99, vocab), [1.0] * 14, pad_id=0)
    out["forward"] = backend.forward(probe)
    reference = ShardedReference(_model(model_path), temperature=1.0, token_budget=40)
    out["reference"] = reference.forward(probe)
    out["reference_one_group"] = reference.forward(probe.select(rank_rows(probe, 2)[0]))  # rank 1: no rows
    one_group = collate(_samples(98, vocab)[:6], [0.1] * 6, pad_id=0)  # one group: rank 1 has no rows
    out["one_group"] = backend.forward_backward(one_group, _batch_loss("ppo_clip", ALGO))
    backend.local.optimizer.zero_grad(set_to_none=True)
    out["metrics"] = _train(backend, vocab, range(SAVE_AT))
    state = backend.state_dict()
    out["metrics"] += _train(backend, vocab, range(SAVE_AT, STEPS))
    out["weights"] = {n: t.clone() for n, t in backend.weights()}
    full = backend.full_state_dict()
    # a fresh (differently initialised) model and optimiser, resumed from the sharded checkpoint
    resumed = ShardedBackend(_model(model_path, seed=1), checkpoint_dir=tmp_path / "shards", **KWARGS)
    with torch.no_grad():
        for p in resumed.model.parameters():
            p.add_(1.0)  # make sure the loaded shards, not the initial weights, are what continues
    resumed.load_state_dict(state)
    out["resumed_metrics"] = _train(resumed, vocab, range(SAVE_AT, STEPS))
    out["resumed_weights"] = {n: t.clone() for n, t in resumed.weights()}
    out["full_keys"] = sorted(full)
    out["full"] = full
    out["critic"] = _critic_run(tmp_path, model_path, vocab)
    torch.save(out, tmp_path / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Spawn the 2-rank run once; return (model path, rank 0's record, rank 1's record)."""
    import torch.multiprocessing as mp

    from tokenmill.testing import build_tiny_model

    tmp = tmp_path_factory.mktemp("sharded")
    path = build_tiny_model(tmp / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    mp.spawn(_worker, args=(2, str(tmp), path), nprocs=2, join=True)
    return path, torch.load(tmp / "rank0.pt", weights_only=False), torch.load(tmp / "rank1.pt", weights_only=False)


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for k, value in want.items():
        assert got[k] == pytest.approx(value, rel=1e-5, abs=1e-7), k


def test_split_is_uneven_and_padding_is_needed(two_ranks):
    _, r0, r1 = two_ranks
    assert all(a != b for a, b in zip(r0["local_rows"], r1["local_rows"], strict=True))
    assert any(a != b for a, b in zip(r0["counts"], r1["counts"], strict=True))


def test_matches_local_backend_step_by_step(two_ranks):
    path, r0, r1 = two_ranks
    local = LocalBackend(_model(path), **KWARGS)
    vocab = local.model.config.vocab_size
    probe = collate(_samples(99, vocab), [1.0] * 14, pad_id=0)
    torch.testing.assert_close(r0["forward"], local.forward(probe), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r1["forward"], r0["forward"], rtol=0, atol=0)
    # the sharded reference (a fresh copy of the initial weights) gives the unsharded one's logprobs
    want_ref = ReferenceModel(_model(path), temperature=1.0, token_budget=40).forward(probe)
    torch.testing.assert_close(r0["reference"], want_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r1["reference"], r0["reference"], rtol=0, atol=0)
    group = probe.select(rank_rows(probe, 2)[0])
    torch.testing.assert_close(r0["reference_one_group"], want_ref[rank_rows(probe, 2)[0]][:, : group.input_ids_B_T.shape[1]],
                               rtol=1e-5, atol=1e-6)
    one_group = collate(_samples(98, vocab)[:6], [0.1] * 6, pad_id=0)
    _close(r0["one_group"], local.forward_backward(one_group, _batch_loss("ppo_clip", ALGO)))
    local.optimizer.zero_grad(set_to_none=True)
    want = _train(local, vocab, range(STEPS))
    for got_r0, got_r1, w in zip(r0["metrics"], r1["metrics"], want, strict=True):
        _close(got_r0, w)  # loss, grad_norm, lr, clip fraction, ... of every step
        assert got_r1 == got_r0
    assert want[0]["grad_norm"] > 0.2  # clipping was active (max_grad_norm 0.2)
    expect = dict(local.weights())
    for name, t in r0["weights"].items():
        torch.testing.assert_close(t, expect[name], rtol=0, atol=1e-5)
        torch.testing.assert_close(r1["weights"][name], t, rtol=0, atol=0)  # every rank holds the same
    assert r0["full_keys"] == sorted(local.model.state_dict()) and r1["full_keys"] == []  # rank 0 only
    torch.testing.assert_close(r0["full"]["lm_head.weight"], r0["weights"]["lm_head.weight"], rtol=0, atol=0)


def test_sharded_checkpoint_resumes_exactly(two_ranks):
    _, r0, r1 = two_ranks
    for r in (r0, r1):
        assert r["resumed_metrics"] == r["metrics"][SAVE_AT:]
        for name, t in r["weights"].items():
            assert torch.equal(r["resumed_weights"][name], t), name


def test_micro_batch_count_matches_the_forward_passes(tiny_model):
    vocab = tiny_model.config.vocab_size
    samples = _samples(0, vocab)
    for budget in (16, 40, 200):
        for share, pack in ((True, False), (False, False), (True, True)):
            for rows in (range(14), range(6, 14), [3]):
                batch = collate([samples[i] for i in rows], [1.0] * len(rows), pad_id=0)
                passes = sum(1 for _ in micro_token_stats(tiny_model, batch, temperature=1.0, token_budget=budget,
                                                          share_prompts=share, pack_sequences=pack))
                assert micro_batch_count(batch, budget, share_prompts=share, pack_sequences=pack) == passes


def test_rank_rows_keeps_groups_whole_and_balances_tokens():
    samples = _samples(0, 50)
    batch = collate(samples, [1.0] * 14, pad_id=0)
    ranks = rank_rows(batch, 2)
    assert sorted(ranks[0] + ranks[1]) == list(range(14))
    prompts = [{tuple(batch.input_ids_B_T[b, : int(batch.prompt_lens_B[b])].tolist()) for b in rows} for rows in ranks]
    assert not prompts[0] & prompts[1]  # no prompt group is split
    assert len(prompts[0]) == 1 and len(prompts[1]) == 4  # the long group alone; the four short ones together
    assert rank_rows(batch, 1) == [list(range(14))]
    assert token_weights([1, 1], "token_mean") == [0.5, 0.5]  # the global weights the split relies on


def test_sharded_critic_matches_the_critic_and_resumes(two_ranks):
    from tokenmill.training.critic import Critic

    path, r0, r1 = two_ranks
    critic = Critic(_critic_model(path), learning_rate=1e-3, total_steps=10, micro_batch_tokens=40)
    vocab = critic.model.config.vocab_size
    batch = collate(_critic_samples(9, vocab), [1.0] * 14, pad_id=0)
    trained = batch.weights_B_T > 0  # values at pad positions depend on the micro-batch's width: never used
    want_values = critic.values(batch) * trained
    torch.testing.assert_close(r0["critic"]["values"] * trained, want_values, rtol=1e-5, atol=1e-6)
    want = _critic_train(critic, vocab, range(3))
    for got, w in zip(r0["critic"]["metrics"], want, strict=True):
        # vf_clip_fraction counts tokens where V_old + (V - V_old) rounds above V: float noise, which a
        # different summation order (or thread count) flips; the loss and the gradient norm are compared
        _close({k: v for k, v in got.items() if k != "critic/vf_clip_fraction"},
               {k: v for k, v in w.items() if k != "critic/vf_clip_fraction"})
    for name, t in critic.model.named_parameters():
        torch.testing.assert_close(r0["critic"]["weights"][name], t.detach(), rtol=0, atol=1e-5)
        assert torch.equal(r1["critic"]["weights"][name], r0["critic"]["weights"][name])
    for r in (r0, r1):
        assert r["critic"]["resumed_metrics"] == r["critic"]["metrics"][2:]
        assert all(torch.equal(r["critic"]["resumed_weights"][n], t) for n, t in r["critic"]["weights"].items())
