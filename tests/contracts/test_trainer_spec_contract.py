"""Every `TrainerSpec` field reaches every policy backend a run can have: the local one, an FSDP2 rank
(`training.backend: fsdp2`) and a Ray trainer rank (`cluster.backend: ray`, built by `rank_backend` as the rank
actor does), each checked on the built object. A field added to the spec without a check here fails the test,
so a new trainer option cannot reach one backend and silently miss another.

The sharded backends run in a one-rank gloo group in this process (file rendezvous, no port)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.controller.ray.workers import BackendSpec, rank_backend
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import collate
from tokenmill.training.logprobs import _OFF
from tokenmill.training.spec import TrainerSpec, policy_backend


def _decoder(model):
    return next(m for m in model.modules() if hasattr(m, "embed_tokens") and hasattr(m, "layers"))


def _factor(local, step: int) -> float:
    return local.scheduler.lr_lambdas[0](step)


# one check per spec field, on the backend's `LocalBackend` (a sharded backend's `.local`) and the module it trains
CHECKS = {
    "learning_rate": lambda b, m, s: b.scheduler.base_lrs == [s.learning_rate],
    "total_steps": lambda b, m, s: _factor(b, s.total_steps) == 0.0 and _factor(b, s.total_steps - 1) > 0.0,
    "weight_decay": lambda b, m, s: b.optimizer.param_groups[0]["weight_decay"] == s.weight_decay,
    "betas": lambda b, m, s: tuple(b.optimizer.param_groups[0]["betas"]) == s.betas,
    "warmup_steps": lambda b, m, s: _factor(b, 0) == pytest.approx(1 / s.warmup_steps),
    "lr_schedule": lambda b, m, s: _factor(b, (s.total_steps + s.warmup_steps) // 2) == pytest.approx(0.5),
    "max_grad_norm": lambda b, m, s: b.max_grad_norm == s.max_grad_norm,
    "micro_batch_tokens": lambda b, m, s: b.micro_batch_tokens == s.micro_batch_tokens,
    "temperature": lambda b, m, s: b.temperature == s.temperature,
    "autocast_dtype": lambda b, m, s: b.autocast_dtype == s.autocast_dtype,
    "share_prompts": lambda b, m, s: b.share_prompts == s.share_prompts,
    "logits_chunk_mib": lambda b, m, s: b.chunk_bytes == int(s.logits_chunk_mib * 2**20),
    "fast_forward": lambda b, m, s: (_decoder(m) in _OFF) == (not s.fast_forward),
    "pack_sequences": lambda b, m, s: b.pack_sequences == s.pack_sequences,
    "track_entropy": lambda b, m, s: b.track_entropy == s.track_entropy,
    "distill": lambda b, m, s: b.distill_teacher is not None and b.distill_coef == s.distill.kl_coef,
    "router_replay": lambda b, m, s: b.router_replay == s.router_replay,
    "activation_checkpointing": lambda b, m, s: b.activation_checkpointing == s.activation_checkpointing and all(
        layer.gradient_checkpointing == s.activation_checkpointing for layer in _decoder(m).layers),
    "kernels": lambda b, m, s: b.kernels == s.kernels,
    "optimizer_offload": lambda b, m, s: b.optimizer_offload == s.optimizer_offload and (
        b.optimizer.param_groups[0]["params"][0].device.type == "cpu"),
    "batch_invariant": lambda b, m, s: b.batch_invariant == s.batch_invariant,
}


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "m", hidden_size=32, num_layers=1, seed=7)


@pytest.fixture
def spec(teacher_path):
    """Every field away from its default (linear schedule: half way between warm-up and the end is 0.5)."""
    return TrainerSpec(
        learning_rate=3e-4, total_steps=41, weight_decay=0.05, betas=(0.8, 0.95), warmup_steps=3,
        lr_schedule="linear", max_grad_norm=0.5, micro_batch_tokens=96, temperature=0.7,
        autocast_dtype=torch.bfloat16, share_prompts=False, logits_chunk_mib=2, fast_forward=False,
        pack_sequences=True, track_entropy=False, activation_checkpointing=True, optimizer_offload=True,
        batch_invariant=True, distill=DistillConfig(teacher={"path": teacher_path}, kl_coef=0.3), router_replay="r3",
    )


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _check_all(backend, spec: TrainerSpec) -> None:
    assert set(CHECKS) == {f.name for f in dataclasses.fields(TrainerSpec)}, "a spec field has no check here"
    local = getattr(backend, "local", backend)
    failed = [name for name, check in CHECKS.items() if not check(local, backend.model, spec)]
    assert not failed, f"spec fields that did not reach {type(backend).__name__}: {failed}"
    assert backend.teacher_in_loss  # what `policy_update` asks before it skips zero-advantage samples


def _teacher(spec, model, tokenizer):
    from tokenmill.training.teacher import build_teacher, loss_teacher

    return loss_teacher(build_teacher(spec.distill, model, tokenizer, torch.device("cpu")), spec.distill)


def _distill_loss_metrics(backend, vocab: int) -> dict[str, float]:
    """One forward-backward with a zero policy loss: what is left is the teacher's KL term."""
    samples = uneven_groups(0, vocab, ((4, 2, 5), (3, 2, 4)))
    batch = collate(samples, [1.0] * len(samples), pad_id=0)

    def zero(logprobs_B_T, micro):
        return (logprobs_B_T * 0.0).sum(), {}

    return backend.forward_backward(batch, zero)


def test_the_local_backend_takes_every_field(spec, tiny_model_path, tokenizer):
    model = _model(tiny_model_path)
    backend = policy_backend(spec, model, teacher=_teacher(spec, model, tokenizer))
    _check_all(backend, spec)
    metrics = _distill_loss_metrics(backend, model.config.vocab_size)
    assert metrics["distill/reverse_kl"] > 0 and metrics["loss"] == pytest.approx(0.3 * metrics["distill/reverse_kl"])


def test_an_fsdp2_rank_takes_every_field(spec, tiny_model_path, tokenizer, one_rank_group, tmp_path):
    model = _model(tiny_model_path)
    with pytest.raises(ValueError, match="training.optimizer_offload: the local backend only"):
        policy_backend(spec, _model(tiny_model_path), teacher=_teacher(spec, model, tokenizer), sharded=True)
    spec = dataclasses.replace(spec, optimizer_offload=False)  # a rank's optimiser state is a shard already
    teacher = _teacher(spec, model, tokenizer)
    backend = policy_backend(spec, model, teacher=teacher, sharded=True, checkpoint_dir=tmp_path / "shards")
    _check_all(backend, spec)


def test_a_ray_rank_takes_every_field_and_loads_its_own_teacher(spec, tiny_model_path, one_rank_group, tmp_path):
    """`rank_backend` is the body of the Ray rank actor's setup: the rank loads the teacher the spec names."""
    model = _model(tiny_model_path)
    spec = dataclasses.replace(spec, optimizer_offload=False)  # refused on every FSDP2 rank (the test above)
    backend = rank_backend(BackendSpec(tiny_model_path, str(tmp_path / "shards"), trainer=spec), model,
                           torch.device("cpu"))
    _check_all(backend, spec)
    metrics = _distill_loss_metrics(backend, model.config.vocab_size)
    assert metrics["distill/reverse_kl"] > 0 and math.isfinite(metrics["loss"])


def test_a_spec_with_a_teacher_refuses_a_backend_without_one(spec, tiny_model_path):
    with pytest.raises(ValueError, match="loss teacher exactly when"):
        policy_backend(spec, _model(tiny_model_path))
    with pytest.raises(ValueError, match="loss teacher exactly when"):
        policy_backend(dataclasses.replace(spec, distill=None), _model(tiny_model_path), teacher=object())
