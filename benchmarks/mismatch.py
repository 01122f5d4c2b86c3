"""How far the engine's logprobs are from the trainer's (`mismatch/*`, `probe/*`) on the quickstart's GRPO
config, for the in-process engine and for a `tokenmill serve` process, and what measuring costs.

    python benchmarks/mismatch.py [--steps 8] [--dtype float32] [--device cpu]

The model is the quickstart's 2-layer architecture, untrained (the gap does not need a trained policy), every
sample trained (`algorithm.skip_zero_advantage` off, so the gap is taken over all of each step's tokens). The
cost is CPU time of one `policy_update` on a quickstart step (16 prompts x 8 samples, every sample trained)
with and without `mismatch`, against the one no-grad forward it would otherwise take. Writes
benchmarks/results/mismatch.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "mismatch.json"
KEYS = ("mismatch/mean_abs", "mismatch/max_abs", "mismatch/kl", "mismatch/out_of_range_frac", "probe/max_abs",
        "mismatch/tokens")


def run(base: Path, out: Path, steps: int, dtype: str, device: str, **overrides) -> dict[str, float]:
    from tokenmill.recipes import grpo

    grpo(base, out, steps=steps, num_eval=8, eval_every=0, console="none", say=lambda _: None,
         **{"model.dtype": dtype, "model.device": device, "algorithm.skip_zero_advantage": False, **overrides})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/mean_abs" in r]
    return {k: max(r[k] for r in rows) for k in KEYS if all(k in r for r in rows)} | {"steps": len(rows)}  # worst step


def update_cost(base: Path, repeats: int = 21) -> dict[str, float]:
    """Median CPU seconds (one thread) of a policy update with and without mismatch, and of a no-grad forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.config import AlgorithmConfig
    from tokenmill.engines import HFEngine
    from tokenmill.health.mismatch import MismatchWatch
    from tokenmill.training.batch import collate
    from tokenmill.training.local import LocalBackend
    from tokenmill.training.update import policy_update
    from tokenmill.types import Sample, SamplingParams

    torch.set_num_threads(1)
    model, tok = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    engine, rng = HFEngine(model, tok, seed=0), random.Random(0)
    prompts = [tok(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", add_special_tokens=False)["input_ids"]
               for _ in range(16)]
    samples = [Sample(tokens=tuple(p) + c.token_ids, loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                      logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="", completion=c.text,
                      stop_reason=c.stop_reason, advantage=1.0 if j % 2 else -1.0)
               for p, group in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6, n=8)), strict=True)
               for j, c in enumerate(group)]
    backend = LocalBackend(model, learning_rate=1e-12, total_steps=100)
    algo, times = AlgorithmConfig(), {"off": [], "on": [], "forward": []}
    for i in range(repeats):
        for mode in ("off", "on", "forward") if i % 2 else ("forward", "on", "off"):
            t0 = time.process_time()
            if mode == "forward":
                backend.forward(collate(samples, [1.0] * len(samples), engine.pad_id))
            else:
                policy_update(samples, backend, algo, pad_id=engine.pad_id, max_tokens=6, rng=random.Random(0),
                              watch=MismatchWatch(backend) if mode == "on" else None)
            times[mode].append(time.process_time() - t0)
    return {f"cpu_s/{k}": statistics.median(v[1:]) for k, v in times.items()}


def main() -> None:
    from tokenmill.recipes import MODEL
    from tokenmill.recipes.tiny import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(build_tiny_model(Path(tmp) / "base", seed=0, **MODEL))
        result = {"in_process": run(base, Path(tmp) / "inproc", args.steps, args.dtype, args.device),
                  "serve": run(base, Path(tmp) / "serve", args.steps, args.dtype, args.device,
                               **{"engine.placement": "process", "engine.sync": "files", "engine.threads": 1,
                                  "engine.timeout_s": 900}),
                  "update_cost": update_cost(base), "dtype": args.dtype, "device": args.device}
    for name in ("in_process", "serve"):
        print(f"{name:10s} " + "  ".join(f"{k} {v:.3g}" for k, v in result[name].items()))
    cost = result["update_cost"]
    print(f"policy_update CPU s: {cost['cpu_s/off']:.4f} without mismatch, {cost['cpu_s/on']:.4f} with; "
          f"a separate no-grad forward would add {cost['cpu_s/forward']:.4f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
