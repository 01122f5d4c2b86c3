"""`tokenmill sft` and `tokenmill preference` on 2 FSDP2 ranks (what `torchrun --nproc_per_node 2` runs; here
spawned with a file rendezvous, gloo): the per-step losses and the trained weights equal one process's, in full
and with LoRA adapters (a DPO policy with LoRA is its own reference, adapters off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

STEPS = 4
SFT_ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b) * (1 + (a % 3))} for a, b in
            [(1, 2), (13, 5), (7, 40), (2, 2), (99, 1), (5, 6), (31, 8), (4, 4), (12, 21), (6, 0)]]
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1) * (1 + a % 2)} for a, b in
         [(1, 2), (3, 4), (10, 5), (7, 7), (20, 1), (2, 9), (8, 8), (30, 3)]]


def _model(path: str, reward: bool = False, lora: int = 0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.config.schema import LoRAConfig
    from tokenmill.training.lora import add_lora
    from tokenmill.training.preference import load_reward_model_for_training

    adapters = LoRAConfig(rank=lora, alpha=2 * max(lora, 1))
    if reward:
        return load_reward_model_for_training(path, seed=0, lora=adapters)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        torch.manual_seed(0)  # the adapters' initial draw: the same on every rank and in one process
        model = add_lora(model, adapters, task_type="CAUSAL_LM", field="model.lora")
    return model, AutoTokenizer.from_pretrained(path)


def _runs(path: str, out: Path | None) -> dict:
    """sft (uneven micro-batch counts per rank), DPO (5 pairs: 3 and 2 per rank) and a reward model, each in
    full and with LoRA adapters: losses and final weights of each (`out`: where the full sft export goes)."""
    from tokenmill.training.preference import run_dpo, run_reward_model
    from tokenmill.training.sft import run_sft

    record = {}
    for lora, tag in ((0, ""), (4, "_lora")):
        model, tok = _model(path, lora=lora)
        record["sft" + tag] = run_sft(model, tok, SFT_ROWS, steps=STEPS, batch_size=6, learning_rate=1e-2,
                                      warmup_steps=1, micro_batch_tokens=24, output_dir=None if lora else out)
        record[f"sft{tag}_weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, tok = _model(path, lora=lora)
        record["dpo" + tag] = run_dpo(model, tok, PAIRS, steps=STEPS, batch_size=5, learning_rate=1e-2,
                                      warmup_steps=1)
        record[f"dpo{tag}_weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, tok = _model(path, reward=True, lora=lora)
        record["rm" + tag] = run_reward_model(model, tok, PAIRS, steps=STEPS, batch_size=5, learning_rate=1e-2,
                                              warmup_steps=1)
        record[f"rm{tag}_weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def _worker(rank: int, world: int, tmp: str, path: str) -> None:
    import torch.distributed as dist

    from tokenmill.training.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=120)
    record = _runs(path, Path(tmp) / "export")
    torch.save(record, Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-rank records of rank 0 and rank 1, the 1-process record, the export folder)."""
    import torch.multiprocessing as mp

    from tokenmill.testing import build_tiny_model

    tmp = tmp_path_factory.mktemp("offline")
    path = build_tiny_model(tmp / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    mp.spawn(_worker, args=(2, str(tmp), path), nprocs=2, join=True)
    torch.set_num_threads(1)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, _runs(path, None), tmp / "export"


@pytest.mark.parametrize("kind", ["sft", "dpo", "rm", "sft_lora", "dpo_lora", "rm_lora"])
def test_two_ranks_train_like_one_process(runs, kind):
    (r0, r1), alone, _ = runs
    assert r0[kind] == r1[kind]  # every rank reports the global loss
    assert r0[kind] == pytest.approx(alone[kind], rel=1e-5)
    assert alone[kind][-1] < alone[kind][0]  # it trained
    want = alone[f"{kind}_weights"]
    # every rank holds the whole trained model at the end. The two ranks all-reduce their gradients in another
    # order than one process sums them, and AdamW divides by the root of the second moment, so a gradient
    # entry near zero can take a step up to the learning rate apart: 1.2e-5 on one of 128 LoRA entries on an
    # AVX-512 CPU, none above 1e-5 on AVX2
    for rank in (r0, r1):
        assert sorted(rank[f"{kind}_weights"]) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(rank[f"{kind}_weights"][name], tensor, rtol=0, atol=5e-5, msg=name)


def test_rank_zero_exports_the_trained_model(runs):
    from safetensors.torch import load_file

    (r0, _), _, export = runs
    saved = load_file(str(export / "model.safetensors"))
    for name, tensor in r0["sft_weights"].items():
        torch.testing.assert_close(saved[name], tensor, msg=name)

