"""A LoRA policy (peft) under FSDP2: 2 CPU ranks (gloo, file rendezvous) train the adapters exactly like
`LocalBackend` in one process, and the reference (the same module with its adapters off) gives the same
logprobs sharded as whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tokenmill.config import AlgorithmConfig
from tokenmill.config.schema import LoRAConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import LocalBackend, collate
from tokenmill.training.update import policy_update

pytest.importorskip("peft")

STEPS = 5
KWARGS = {"learning_rate": 1e-2, "total_steps": STEPS * 2, "micro_batch_tokens": 40, "warmup_steps": 1}
ALGO = AlgorithmConfig(mini_batches=2)


def _samples(step: int, vocab: int):
    return uneven_groups(step, vocab, ((8, 6, 12), (2, 2, 3), (3, 2, 3), (2, 2, 2), (4, 2, 3)))


def _lora_model(path: str):
    from transformers import AutoModelForCausalLM

    from tokenmill.training.lora import add_lora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)  # the adapters' initial A matrices: the same draw on every rank and in one process
    return add_lora(model, LoRAConfig(rank=4, alpha=8), task_type="CAUSAL_LM", field="model.lora")


def _run(backend, reference, vocab: int) -> dict:
    out = {"metrics": [policy_update(_samples(s, vocab), backend, ALGO, pad_id=0, max_tokens=12,
                                     rng=random.Random(s)) for s in range(STEPS)]}
    probe = collate(_samples(99, vocab), [1.0] * 14, pad_id=0)
    out["reference"] = reference.forward(probe)
    out["policy"] = backend.forward(probe)
    out["weights"] = {n: t.detach().clone() for n, t in backend.weights()}
    return out


def _worker(rank: int, world: int, tmp: str, path: str) -> None:
    import torch.distributed as dist

    from tokenmill.training.dist import init_distributed
    from tokenmill.training.sharded import ShardedBackend, ShardedReference

    torch.set_num_threads(1)
    init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=120)
    backend = ShardedBackend(_lora_model(path), **KWARGS)
    reference = ShardedReference(backend.model, temperature=1.0, token_budget=40, adapters_off=True)
    torch.save(_run(backend, reference, backend.model.config.vocab_size), Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from tokenmill.testing import build_tiny_model
    from tokenmill.training.local import ReferenceModel

    tmp = tmp_path_factory.mktemp("sharded_lora")
    path = build_tiny_model(tmp / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    mp.spawn(_worker, args=(2, str(tmp), path), nprocs=2, join=True)
    torch.set_num_threads(1)
    model = _lora_model(path)
    backend = LocalBackend(model, **KWARGS)
    reference = ReferenceModel(model, temperature=1.0, token_budget=40, adapters_off=True)
    alone = _run(backend, reference, model.config.vocab_size)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)], alone


def test_lora_on_two_ranks_trains_like_one_process(lora_runs):
    ranks, alone = lora_runs
    assert alone["weights"] and all("lora_" in n for n in alone["weights"])  # only the adapters train
    for got in ranks:
        for step, (g, w) in enumerate(zip(got["metrics"], alone["metrics"], strict=True)):
            assert g.keys() == w.keys()
            for k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (step, k)
        assert sorted(got["weights"]) == sorted(alone["weights"])
        for name, tensor in alone["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(got["policy"], alone["policy"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["reference"], alone["reference"], rtol=0, atol=1e-5)
    assert (alone["policy"] - alone["reference"]).abs().max() > 1e-3  # the adapters trained, and were off
