"""Router replay on a tiny random-init Qwen3-MoE: the engine/trainer mismatch with replay off, r2 and r3, and a
short GRPO run with r3 against one without.

    python benchmarks/router_replay.py [--steps 40] [--sft-steps 300]

Part 1 (mismatch): an engine on a copy of the model samples 96 completions of up to 20 tokens in bf16 autocast
while recording its routing; the fp32 trainer scores the same tokens with replay off, r2 (its own routing: the
same as off for this pass) and r3 (the engine's routing). Also: the share of tokens on which some layer's
expert set differs, and the share of trained tokens each off-policy mask (`icepop` [0.8, 1.25], `binary_kl` 1e-3)
would drop, off and r3.
Part 2 (learning): the MoE gets a short supervised warm start on addition (as the quickstart's dense model),
then GRPO (16 prompts x 8 samples, 6 tokens) with `training.router_replay` off and r3; held-out greedy accuracy
on 300 problems before and after. Writes benchmarks/results/router_replay.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "router_replay.json"
MOE = {"hidden_size": 64, "num_layers": 2, "num_experts": 8, "top_k": 2, "expert_size": 64}


def mismatch(base: str) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.algorithms.losses import behaviour_weights
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.health.mismatch import mismatch_stats
    from tokenmill.training import LocalBackend, collate
    from tokenmill.training.router_replay import trainer_routes
    from tokenmill.types import Sample, SamplingParams, StopReason

    model, tok = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    engine = HFEngine(copy.deepcopy(model), tok, seed=1, autocast_dtype=torch.bfloat16)
    engine.record_routing(True)
    prompts = [[5 + i, 6 + i, 7, 8 + i, 9] for i in range(12)]
    out = engine.generate(prompts, SamplingParams(n=8, max_tokens=20, temperature=1.0))
    samples = [Sample(tokens=tuple(p) + c.token_ids, loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                      logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="", completion=c.text,
                      stop_reason=StopReason.STOP, routes=c.routes)
               for p, group in zip(prompts, out, strict=True) for c in group]
    batch = collate(samples, [1.0] * len(samples), tok.pad_token_id)
    trained = batch.weights_B_T > 0
    with torch.no_grad():
        own = trainer_routes(model, batch, 8192)
    known = (batch.routes_B_T_R >= 0).all(-1) & trained
    k = engine.model.config.num_experts_per_tok
    sets = lambda r: torch.cat([r[..., i:i + k].sort(-1).values for i in range(0, r.shape[-1], k)], -1)
    flipped = (sets(own) != sets(batch.routes_B_T_R)).any(-1) & known
    rows: dict[str, dict[str, float]] = {}
    for mode in ("off", "r2", "r3"):
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, router_replay=mode)
        # r2 replays the trainer's own pre-update routing: this pass records it, so it scores as off does
        scored = backend.forward(batch if mode != "r2" else collate(
            [s.with_(routes=()) for s in samples], [1.0] * len(samples), tok.pad_token_id))
        rows[mode] = mismatch_stats(batch.old_logprobs_B_T, scored, trained)
        for mask, kwargs in (("icepop", {"ratio_band": (0.8, 1.25)}), ("binary_kl", {"kl_band": 1e-3})):
            c, _ = behaviour_weights(scored.double(), batch.old_logprobs_B_T.double(), mask, 2.0, **kwargs)
            rows[mode][f"{mask}_masked_frac"] = float(((c == 0) & trained).sum() / trained.sum())
    rows["routing"] = {"tokens": float(known.sum()), "expert_set_differs_frac": float(flipped.sum() / known.sum())}
    return rows


def learning(out: Path, steps: int, sft_steps: int) -> dict[str, dict[str, float]]:
    from tokenmill.config.schema import ModelConfig
    from tokenmill.data.registry import task_splits
    from tokenmill.recipes import grpo
    from tokenmill.recipes.tiny import build_tiny_moe_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    base = build_tiny_moe_model(out / "base", **MOE)
    train_rows, _, _ = task_splits("addition", 20000, 300, seed=0, slip=0.6)
    model, tok = load_policy(ModelConfig(path=base), resolve_device("cpu"))
    t0 = time.time()
    run_sft(model, tok, train_rows, steps=sft_steps, batch_size=64, learning_rate=1e-3, seed=0,
            output_dir=out / "warm")
    print(f"warm start: {sft_steps} SFT steps in {time.time() - t0:.0f}s")
    rows = {}
    for mode in ("off", "r3"):
        t0 = time.time()
        result = grpo(out / "warm", out / mode, steps=steps, num_eval=300, eval_every=0, console="none",
                      say=lambda _: None, **{"training.router_replay": mode})
        rows[mode] = {"eval_start": result["eval_before"]["eval/accuracy"],
                      "eval_end": result["eval_after"]["eval/accuracy"], "seconds": round(time.time() - t0, 1)}
        print(mode, rows[mode])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--skip-learning", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        from tokenmill.recipes.tiny import build_tiny_moe_model

        table = mismatch(build_tiny_moe_model(Path(tmp) / "moe", **MOE))
        print(f"{'replay':8} {'mean_abs':>9} {'max_abs':>8} {'kl':>9} {'icepop':>7} {'binary_kl':>9}")
        for mode in ("off", "r2", "r3"):
            r = table[mode]
            print(f"{mode:8} {r['mismatch/mean_abs']:9.2e} {r['mismatch/max_abs']:8.3f} {r['mismatch/kl']:9.2e} "
                  f"{r['icepop_masked_frac']:7.4f} {r['binary_kl_masked_frac']:9.4f}")
        print(f"tokens whose expert set differs in some layer: {table['routing']['expert_set_differs_frac']:.3f}")
        result = {"mismatch": table}
        if not args.skip_learning:
            result["learning"] = learning(Path(tmp), args.steps, args.sft_steps)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
