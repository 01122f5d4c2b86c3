"""1 rank against 2 FSDP2 ranks on the same global batch: step time, time in communication, peak memory.

    python benchmarks/scaling.py                 # ~25M-parameter Llama, 16 x 128 tokens, 3 timed steps
    python benchmarks/scaling.py --layers 2 --hidden 128 --steps 2     # a quick look

One rank runs `LocalBackend` (no process group); N ranks run `ShardedBackend` (FSDP2, gloo on CPU, NCCL on a
GPU machine), spawned with torch.multiprocessing and a file rendezvous (no ports). Each step is one PPO-loss
forward/backward over the global batch plus the optimiser step (`policy_update` with one mini-batch). Per
rank: the median step time, the time the collectives themselves took per step (the profiler's `gloo:` /
`nccl:` events: all-gathers of the weights in every forward and backward, reduce-scatters of the gradients,
and the small all-reduces of micro-batch counts, metrics and the gradient norm; they may overlap compute), and
the peak RSS of the process.

Timings on a shared CPU are noisy upper bounds (every rank runs one thread); the point of the CPU run is the
shape (what the communication costs next to the compute, what sharding saves in memory), not the speed.
Results go to benchmarks/results/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.config import AlgorithmConfig
from tokenmill.types import Sample, StopReason

RESULTS = Path(__file__).parent / "results" / "scaling.json"


def _model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to("cuda" if torch.cuda.is_available() else "cpu")


def _samples(args, step: int) -> list[Sample]:
    """`args.prompts` groups of `args.group` sequences of about `args.tokens` tokens sharing a 16-token prompt."""
    rng = random.Random(step)
    out = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(3, args.vocab) for _ in range(16)]
        for _ in range(args.group):
            completion = [rng.randrange(3, args.vocab) for _ in range(rng.randint(args.tokens // 2, args.tokens - 16))]
            out.append(Sample(tokens=tuple(prompt + completion), loss_mask=(0,) * 16 + (1,) * len(completion),
                              logprobs=(0.0,) * 16 + tuple(-2.0 for _ in completion), prompt_len=16, prompt="p",
                              completion="c", stop_reason=StopReason.STOP, advantage=rng.uniform(-1, 1)))
    return out


def _comm_seconds(prof) -> float:
    total_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith(("gloo:", "nccl:")))
    return total_us / 1e6


def _measure(backend, args) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.training.update import policy_update

    algo = AlgorithmConfig(skip_zero_advantage=False)

    def step(s: int) -> float:
        start = time.perf_counter()
        policy_update(_samples(args, s), backend, algo, pad_id=0, max_tokens=args.tokens, rng=random.Random(s))
        return time.perf_counter() - start

    step(-1)  # warm-up: allocations, first-call costs
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        times = [step(s) for s in range(args.steps)]
    out = {"step_s": statistics.median(times), "comm_s_per_step": _comm_seconds(prof) / args.steps,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _kwargs(args) -> dict:
    return {"learning_rate": 1e-5, "total_steps": 100, "micro_batch_tokens": args.micro_batch_tokens}


def _rank(rank: int, world: int, tmp: str, args) -> None:
    import torch.distributed as dist

    from tokenmill.training.dist import init_distributed
    from tokenmill.training.sharded import ShardedBackend

    torch.set_num_threads(1)
    init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=600)
    backend = ShardedBackend(_model(args), **_kwargs(args))
    result = _measure(backend, args)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = sum(p.numel() for p in _model(args).parameters())
    print(f"model: {params / 1e6:.1f}M parameters; batch: {args.prompts} x {args.group} sequences of "
          f"<= {args.tokens} tokens")

    from tokenmill.training.local import LocalBackend

    one = _measure(LocalBackend(_model(args), **_kwargs(args)), args)
    print(f"1 rank (LocalBackend): {one}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.ranks, tmp, args), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    for r, result in enumerate(ranks):
        print(f"{args.ranks} ranks (FSDP2), rank {r}: {result}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "device": "cuda" if torch.cuda.is_available() else "cpu", "parameters": params, "args": vars(args),
        "one_rank": one, "ranks": ranks,
    }, indent=1))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
