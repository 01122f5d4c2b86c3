"""Decode over the paged key/value cache against the static one: tokens/s of `HFEngine.generate`, same model.

    python benchmarks/paged_decode.py                        # CPU, a small Qwen3-shaped model (~2 min)
    python benchmarks/paged_decode.py --batches 1 8 --new-tokens 32 --variants static paged_gather

Variants (each an `HFEngine` on the same model, prompts and seed):

- static:          the default: one buffer per call, attention over all of it with a mask (on a GPU: the
                   compiled step in a CUDA graph)
- paged_gather:    `kv_cache: paged`, attention over the rows' gathered blocks
- paged_flex:      `kv_cache: paged`, FlexAttention over the pool (uncompiled on a CPU: the reference path,
                   which scores every position of the pool, so run up to batch 8 there; on a GPU compiled,
                   in a CUDA graph per bucket)
- paged_device:    `paged_gather` (`paged_flex` on a GPU) with `sample_on_device: true`, tokens copied every 8 steps
- static_groups / paged_groups: the same with GRPO-shaped groups (batch/8 prompts, n = 8 samples each), where
  the paged cache stores each prompt once

Rows decode exactly `new_tokens` (end-of-sequence is switched off), prompts of `prompt_tokens` random ids.
Each variant runs once untimed at the timed size first (compiling, allocator, rotary tables), then `repeats`
rounds in which the variants take turns. Printed: the best round's tokens/s per variant and batch, the
median tokens per CPU-second of this process (steadier than wall time on a shared machine), and each
variant's ratio to `static` (`static_groups` for the group variants). The GPU suite calls
`run_decode_bench(model, batch_sizes, new_tokens, device)`. Results: benchmarks/results/paged_decode.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from tokenmill.engines import HFEngine
from tokenmill.recipes.tiny import build_tokenizer
from tokenmill.types import SamplingParams

VARIANTS = ("static", "paged_gather", "paged_flex", "paged_device", "static_groups", "paged_groups")
CPU_FLEX_ROWS = 8  # uncompiled FlexAttention scores every position of the pool: slow past a few rows
SHAPE = {"vocab_size": 2000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 4096}


def engine_options(variant: str, device: str) -> dict:
    """The `HFEngine` keyword arguments of a variant."""
    flex_or_gather = "flex" if device.startswith("cuda") else "gather"
    return {"static": {}, "static_groups": {},
            "paged_gather": {"kv_cache": "paged", "paged_attention": "gather"},
            "paged_flex": {"kv_cache": "paged", "paged_attention": "flex"},
            "paged_device": {"kv_cache": "paged", "paged_attention": flex_or_gather, "sample_on_device": True},
            "paged_groups": {"kv_cache": "paged", "paged_attention": flex_or_gather}}[variant]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_generate(engine: HFEngine, prompts: list[list[int]], params: SamplingParams,
                   device: str) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, generated tokens) of one `generate`."""
    engine.generator.manual_seed(1)
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, params)
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu, sum(len(c.token_ids) for g in out for c in g)


def run_decode_bench(model, batch_sizes: list[int], new_tokens: int, device: str, *, tokenizer=None,
                     prompt_tokens: int = 128, variants: tuple[str, ...] = VARIANTS, group: int = 8,
                     repeats: int = 3) -> dict:
    """Decode tokens/s of each variant at each batch size (rows = prompts x samples), the fastest of
    `repeats` rounds (the variants take turns within a round, so a busy machine slows them alike), and the
    ratio of each to the static cache. `model`: a Llama/Qwen-family causal LM already on `device` (its
    dtype is used)."""
    tokenizer = tokenizer or build_tokenizer()
    rng = random.Random(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = [[rng.randrange(7, vocab) for _ in range(prompt_tokens)] for _ in range(max(batch_sizes))]
    engines = {v: HFEngine(model, tokenizer, seed=0, **engine_options(v, device)) for v in variants}
    for engine in engines.values():
        engine.eos_ids = set()  # every row decodes new_tokens
    rows = []
    for batch in batch_sizes:
        runs: dict[str, list[tuple[float, float]]] = {}
        for round_ in range(repeats + 1):  # round 0 warms up (compiling, allocator, rotary tables)
            for variant, engine in engines.items():
                n = group if variant.endswith("_groups") else 1
                if batch % n or (variant == "paged_flex" and not device.startswith("cuda") and batch > CPU_FLEX_ROWS):
                    continue
                params = SamplingParams(max_tokens=new_tokens, temperature=1.0, n=n)
                seconds, cpu_seconds, tokens = _time_generate(engine, prompts[: batch // n], params, device)
                if round_:
                    runs.setdefault(variant, []).append((tokens / seconds, tokens / max(cpu_seconds, 1e-9)))
        for variant, speeds in runs.items():
            wall, cpu = [w for w, _ in speeds], [c for _, c in speeds]
            row = {"variant": variant, "batch": batch, "tokens_per_s": round(max(wall), 1),
                   "tokens_per_s_median": round(statistics.median(wall), 1),
                   "tokens_per_cpu_s": round(statistics.median(cpu), 1),
                   "samples_per_prompt": group if variant.endswith("_groups") else 1}
            if engines[variant].paged.last_pool is not None:
                row["kv_blocks"] = engines[variant].paged.last_pool.capacity
            rows.append(row)
            print(json.dumps(row), flush=True)
    for key, ratio in (("tokens_per_s", "vs_static"), ("tokens_per_cpu_s", "vs_static_cpu")):
        by = {(r["variant"], r["batch"]): r[key] for r in rows}
        for r in rows:
            base = by.get(("static_groups" if r["variant"].endswith("_groups") else "static", r["batch"]))
            r[ratio] = round(r[key] / base, 3) if base else None
    return {"device": device, "torch": torch.__version__, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens,
            "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows}


def build_model(device: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=dtype)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default="benchmarks/results/paged_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = run_decode_bench(build_model(args.device), args.batches, args.new_tokens, args.device,
                              prompt_tokens=args.prompt_tokens, variants=tuple(args.variants),
                              repeats=args.repeats)
    report |= {"shape": SHAPE, "machine": platform.processor() or platform.machine()}
    print(f"\n{'variant':<14} {'batch':>5} {'tokens/s':>10} {'vs static':>9} {'tokens/CPU s':>12} {'vs static':>9}")
    for r in report["rows"]:
        print(f"{r['variant']:<14} {r['batch']:>5} {r['tokens_per_s']:>10} {r['vs_static'] or '':>9} "
              f"{r['tokens_per_cpu_s']:>12} {r['vs_static_cpu'] or '':>9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
