"""Packed training rows with the dense [rows, L, L] mask against attention by segments: peak memory and time
of one forward + backward (`packed_token_stats`: logprobs and entropy of every completion token) as the
row grows. One packed row: a 256-token prompt and 256-token completions up to L; a 2-layer Llama with
hidden size 64 and 4 query heads on 2 key/value heads. Each measurement runs in a child process (peak RSS
is its own).

    python benchmarks/packed_attention.py [--widths 2048 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time
from pathlib import Path

PROMPT, COMPLETION = 256, 256


def measure(width: int, min_width: int, queue) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tokenmill.training import collate
    from tokenmill.training.packing import micro_packs, packed_token_stats
    from tokenmill.types import Sample, StopReason

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=width)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prompt = torch.randint(3, 512, (PROMPT,)).tolist()
    samples = []
    for _ in range((width - PROMPT) // COMPLETION):
        completion = torch.randint(3, 512, (COMPLETION,)).tolist()
        samples.append(Sample(tokens=tuple(prompt + completion), loss_mask=(0,) * PROMPT + (1,) * COMPLETION,
                              logprobs=(0.0,) * (PROMPT + COMPLETION), prompt_len=PROMPT, prompt="p",
                              completion="c", stop_reason=StopReason.STOP, advantage=1.0))
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    for micro, packed in micro_packs(batch, width):
        lp, ent = packed_token_stats(model, packed, tuple(micro.input_ids_B_T.shape), temperature=1.0,
                                     entropy=True, min_width=min_width)
        (lp.sum() + ent.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"width": int(packed.input_ids_R_L.shape[1]), "peak_rss_mib": round(peak / 1024, 1),
               "rss_growth_mib": round((peak - before) / 1024, 1), "seconds": round(seconds, 3),
               "logprob_sum": round(float(lp.detach().sum()), 3)})


def run(width: int, min_width: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=measure, args=(width, min_width, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "packed_attention.json"))
    args = parser.parse_args()
    rows = []
    print("| row width | dense mask: RSS growth, s | segments: RSS growth, s | same logprobs |")
    print("|---|---|---|---|")
    for width in args.widths:
        dense, segments = run(width, 10**9), run(width, 0)
        same = abs(dense["logprob_sum"] - segments["logprob_sum"]) < 1e-2 * max(1.0, abs(dense["logprob_sum"]))
        rows.append({"width": width, "dense": dense, "segments": segments, "same_logprob_sum": same})
        print(f"| {dense['width']} | {dense['rss_growth_mib']} MiB, {dense['seconds']} | "
              f"{segments['rss_growth_mib']} MiB, {segments['seconds']} | {same} |", flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
