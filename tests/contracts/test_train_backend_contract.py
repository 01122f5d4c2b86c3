"""The `TrainBackend` contract (training/base.py), run against every backend that ships.

`forward(batch)` gives each token's logprob under the current weights, aligned with `input_ids_B_T` (equal to
a teacher-forced pass within 1e-5); `forward_backward` accumulates gradients and returns summed metrics;
`optim_step` applies them and reports grad_norm and lr; `weights()` yields exactly the parameters that train,
by the module's names; `state_dict` / `load_state_dict` resume exactly (N steps, save, one more step equals a
fresh backend loaded from the save taking that step, bit for bit).

Adding a backend is one entry in `BACKENDS`.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill.testing.reference import teacher_logprobs
from tokenmill.training import LocalBackend, collate
from tokenmill.training.base import TrainBackend
from tokenmill.types import Sample, StopReason


def local(model, tmp_path) -> tuple[torch.nn.Module, TrainBackend]:
    backend = LocalBackend(model, **OPTIM)
    return model, backend


def local_lora(model, tmp_path) -> tuple[torch.nn.Module, TrainBackend]:
    from tokenmill.config.schema import LoRAConfig
    from tokenmill.training.lora import add_lora

    return local(add_lora(model, LoRAConfig(rank=4, alpha=8), task_type="CAUSAL_LM", field="model.lora"), tmp_path)


def sharded(model, tmp_path) -> tuple[torch.nn.Module, TrainBackend]:
    """FSDP2 on a one-rank gloo group (the multi-rank equivalence is tests/unit/training/test_sharded.py's)."""
    from tokenmill.training.dist import init_distributed
    from tokenmill.training.sharded import ShardedBackend

    init_distributed(init_method=f"file://{tmp_path}/process-group", rank=0, world_size=1, timeout_s=120)
    backend = ShardedBackend(model, checkpoint_dir=tmp_path / "shards", **OPTIM)
    return backend.model, backend


OPTIM = {"learning_rate": 1e-2, "total_steps": 10, "warmup_steps": 1, "lr_schedule": "cosine",
         "micro_batch_tokens": 24}  # several micro-batches per batch
# name -> (the policy as loaded, a scratch folder) -> (the module that trains, its backend)
BACKENDS: dict[str, Callable[..., tuple[torch.nn.Module, TrainBackend]]] = {
    "local": local, "local-lora": local_lora, "sharded-1-rank": sharded,
}


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one plain tensor (an FSDP2 parameter is a DTensor shard)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def samples(vocab: int, seed: int) -> list[Sample]:
    """Two prompts with three completions each, seeded advantages."""
    rng = random.Random(seed)
    out = []
    for prompt_len in (3, 5):
        prompt = [rng.randint(7, vocab - 1) for _ in range(prompt_len)]
        for _ in range(3):
            completion = [rng.randint(7, vocab - 1) for _ in range(rng.randint(1, 5))]
            out.append(Sample(
                tokens=tuple(prompt + completion), loss_mask=(0,) * prompt_len + (1,) * len(completion),
                logprobs=(0.0,) * (prompt_len + len(completion)), prompt_len=prompt_len, prompt="p",
                completion="c", stop_reason=StopReason.STOP, advantage=rng.uniform(-1.0, 1.0)))
    return out


def policy_gradient(logprobs_B_T, batch):
    """-sum(A * logprob) over trained tokens: the simplest loss with the `BatchLoss` signature."""
    weighted = logprobs_B_T * batch.weights_B_T * batch.advantages_B[:, None]
    return -weighted.sum(), {"tokens": batch.weights_B_T.sum().detach()}


@pytest.fixture(params=sorted(BACKENDS))
def make(request, tiny_model_path, tmp_path):
    def build():  # a resumed backend shares the run's folder with the one it resumes
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        return BACKENDS[request.param](model, tmp_path)

    yield build
    import torch.distributed as dist

    if dist.is_initialized():  # the one-rank group of the sharded backend: leave none behind
        dist.destroy_process_group()


def step(backend, batch) -> dict[str, float]:
    metrics = backend.forward_backward(batch, policy_gradient)
    return {**metrics, **backend.optim_step()}


def test_forward_gives_teacher_forced_logprobs_aligned_with_the_tokens(make, tokenizer):
    model, backend = make()
    methods = protocol_methods(TrainBackend)
    assert {"forward", "forward_backward", "optim_step", "weights", "state_dict"} <= set(methods)
    assert all(callable(getattr(backend, m, None)) for m in methods)
    batch_samples = samples(len(tokenizer), seed=0)
    batch = collate(batch_samples, [1.0] * len(batch_samples), pad_id=tokenizer.pad_token_id)
    logprobs_B_T = backend.forward(batch)
    assert logprobs_B_T.shape == batch.input_ids_B_T.shape and not logprobs_B_T.requires_grad
    model.eval()
    for row, index in enumerate(batch.sample_index_B.tolist()):
        s = batch_samples[index]
        expected = teacher_logprobs(model, s.tokens[: s.prompt_len], s.completion_ids)
        got = logprobs_B_T[row, s.prompt_len : len(s.tokens)].tolist()
        assert got == pytest.approx(expected, abs=1e-5)


def test_a_step_trains_exactly_the_weights_it_reports(make, tokenizer):
    model, backend = make()
    names = [n for n, _ in backend.weights()]
    assert names and names == [n for n, p in model.named_parameters() if p.requires_grad]
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    batch_samples = samples(len(tokenizer), seed=1)
    batch = collate(batch_samples, [1.0] * len(batch_samples), tokenizer.pad_token_id)
    for _ in range(2):  # LoRA's A matrices move from the second step on (B starts at 0)
        metrics = step(backend, batch)
        assert metrics["tokens"] == sum(sum(s.loss_mask) for s in batch_samples)  # summed over micro-batches
        assert metrics["grad_norm"] > 0 and metrics["lr"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(full(p.detach()), before[n])}
    assert changed == set(names)


def test_state_dict_resumes_exactly(make, tokenizer):
    batches = [samples(len(tokenizer), seed=s) for s in (2, 3, 4)]
    collated = [collate(b, [1.0] * len(b), tokenizer.pad_token_id) for b in batches]
    model, backend = make()
    for batch in collated[:2]:
        step(backend, batch)
    saved_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_state = copy.deepcopy(backend.state_dict())  # as a checkpoint holds it (the live one moves on)
    step(backend, collated[2])

    resumed_model, resumed = make()
    with torch.no_grad():
        for n, p in resumed_model.named_parameters():
            p.copy_(saved_weights[n])
    resumed.load_state_dict(saved_state)
    step(resumed, collated[2])
    for (n, p), (_, q) in zip(model.named_parameters(), resumed_model.named_parameters(), strict=True):
        assert torch.equal(full(p.detach()), full(q.detach())), n


def nan_loss(logprobs_B_T, batch):
    """A loss whose gradient is NaN everywhere it reaches (a NaN advantage, as a bad input gives one)."""
    loss, metrics = policy_gradient(logprobs_B_T, batch)
    return loss * torch.tensor(float("nan")), metrics


def test_a_non_finite_update_is_skipped_and_the_schedule_advances(make, tokenizer):
    """A NaN gradient is never applied: weights and optimiser state stay bit for bit, the metrics say so, the
    lr reported is the one each step applied, and the schedule advances as for a step taken."""
    model, backend = make()
    batch_samples = samples(len(tokenizer), seed=5)
    batch = collate(batch_samples, [1.0] * len(batch_samples), tokenizer.pad_token_id)
    first = step(backend, batch)  # warm-up step 1 of 1: lr 1e-2 x 1
    assert "skipped_nonfinite" not in first and first["lr"] == pytest.approx(1e-2)
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    optimizer = getattr(backend, "local", backend).optimizer  # the sharded backend's is its local one's
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    backend.forward_backward(batch, nan_loss)
    skipped = backend.optim_step()
    assert skipped["skipped_nonfinite"] == 1 and math.isnan(skipped["grad_norm"])
    assert skipped["lr"] == pytest.approx(1e-2)  # the cosine's first step after warm-up (progress 0)
    for n, p in model.named_parameters():
        assert torch.equal(full(p.detach()), before[n]), n
    after = optimizer.state_dict()["state"]
    assert after.keys() == moments.keys()
    for k in moments:
        for name, value in moments[k].items():
            assert torch.equal(full(after[k][name]), full(value)), (k, name)
    again = step(backend, batch)  # the next step applies again, at the schedule's next lr, from clean gradients
    assert "skipped_nonfinite" not in again and math.isfinite(again["grad_norm"])
    assert again["lr"] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 1 / 9)))
    assert any(not torch.equal(full(p.detach()), before[n]) for n, p in model.named_parameters())
