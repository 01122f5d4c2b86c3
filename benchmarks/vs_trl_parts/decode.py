"""`vs_trl.py --decode-only`: tokenmill's in-process engine with its fast decode step on and off, on the warm
model and the benchmark's prompts and sampling settings, `generate()` calls interleaved (so both see the same
machine load), no training. Reports the median call, tokens/s, and how far both sampled the same tokens."""

from __future__ import annotations

import statistics
import time
from typing import Any


def compare_decode(spec: dict[str, Any], rounds: int = 40) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.data.registry import task_splits
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.types import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rows, _, _ = task_splits("addition", spec["num_train"], spec["num_eval"], seed=spec["seed"])
    per_call = spec["prompts_per_step"]
    prompts = [tokenizer(p)["input_ids"] for p in rows["prompt"][: per_call * (rounds + 1)]]
    params = SamplingParams(max_tokens=spec["max_new_tokens"], n=spec["group_size"],
                            temperature=spec["temperature"])
    engines = {"plain": HFEngine(model, tokenizer, seed=spec["seed"], fast_decode=False),
               "fast": HFEngine(model, tokenizer, seed=spec["seed"])}
    for engine in engines.values():  # warm-up call, not timed
        engine.generate(prompts[-per_call:], params)
    seconds: dict[str, list[float]] = {k: [] for k in engines}
    outputs: dict[str, list] = {k: [] for k in engines}
    for r in range(rounds):
        batch = prompts[r * per_call : (r + 1) * per_call]
        for kind in ("fast", "plain") if r % 2 == 0 else ("plain", "fast"):
            start = time.perf_counter()
            outputs[kind].append(engines[kind].generate(batch, params))
            seconds[kind].append(time.perf_counter() - start)
    pairs = [(a, b) for x, y in zip(outputs["fast"], outputs["plain"], strict=True)
             for ga, gb in zip(x, y, strict=True) for a, b in zip(ga, gb, strict=True)]
    tokens = sum(len(a.token_ids) for a, _ in pairs)
    # tokens are drawn by inverse CDF from the same uniforms: a row can part where u falls within rounding
    # (~1e-7) of a boundary between two tokens; the logprobs are compared up to where the rows part
    prefixes = [_common_prefix(a.token_ids, b.token_ids) for a, b in pairs]
    result: dict[str, Any] = {
        "rounds": rounds,
        "same_tokens": all(a.token_ids == b.token_ids for a, b in pairs),
        "rows_parted": sum(a.token_ids != b.token_ids for a, b in pairs),
        "rows": len(pairs),
        "max_logprob_difference": max(abs(u - v) for (a, b), n in zip(pairs, prefixes, strict=True)
                                      for u, v in zip(a.logprobs[:n], b.logprobs[:n])),
        "generated_tokens": tokens,
    }
    for kind in engines:
        result[kind] = {"median_call_ms": 1e3 * statistics.median(seconds[kind]),
                        "generated_tok_s": tokens / sum(seconds[kind])}
    result["fast_over_plain_tok_s"] = result["fast"]["generated_tok_s"] / result["plain"]["generated_tok_s"]
    return result


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_decode(spec: dict[str, Any], result: dict[str, Any]) -> None:
    shape = f"{spec['prompts_per_step']} x {spec['group_size']}, max {spec['max_new_tokens']} new tokens"
    print(f"\nin-process engine generate(), {shape}, {spec['threads']} thread(s), {result['rounds']} calls each")
    for kind in ("plain", "fast"):
        r = result[kind]
        print(f"  {kind:5s}  median call {r['median_call_ms']:7.1f} ms   {r['generated_tok_s']:8.0f} generated tok/s")
    print(f"  fast / plain: {result['fast_over_plain_tok_s']:.2f}x tokens/s; rows that parted on a near-tie: "
          f"{result['rows_parted']} of {result['rows']}; largest logprob difference before that "
          f"{result['max_logprob_difference']:.1e}")
