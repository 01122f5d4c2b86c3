"""Router replay on a tiny random-init Qwen3-MoE: the engine/trainer mismatch with replay off, r2 and r3, and a
short GRPO run with r3 against one without.

    python benchmarks/router_replay.py [--steps 30] [--skip-learning] [--engine local|served]

Part 1 (mismatch): an engine on a copy of the model samples 96 completions of up to 20 tokens in bf16 autocast
while recording its routing; the fp32 trainer scores the same tokens with replay off, r2 (its own routing: the
same as off for this pass) and r3 (the engine's routing). Also: the share of tokens on which some layer's
expert set differs, and the share of trained tokens each off-policy mask (`icepop` [0.8, 1.25], `binary_kl` 1e-3)
would drop, off and r3. `--engine served` samples through `tokenmill serve` on loopback instead (a continuous
engine in bf16 autocast recording its routing, behind the OpenAI app; `RemoteEngine` asks each request for its
`routed_experts`); results then go to router_replay_served.json.
Part 2 (learning): GRPO from the random-init MoE (8 prompts x 8 samples of 8 tokens a step, learning rate
1e-3), rewarded with the share of digits in the completion (`digit_share` below), `training.router_replay` off
and r3, through tokenmill's own run; the mean reward over the first and the last five steps. Writes
benchmarks/results/router_replay.json.
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


def sample(model, tok, prompts, params, where: str):
    """The completions of a bf16 engine on a copy of `model` that records its routing: in process (local) or
    behind `tokenmill serve`'s app on loopback, read by `RemoteEngine` (served)."""
    from tokenmill.engines.local.continuous import ContinuousEngine
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.engines.server.app import create_app
    from tokenmill.serving import start_in_thread

    if where == "local":
        engine = HFEngine(copy.deepcopy(model), tok, seed=1, autocast_dtype=torch.bfloat16)
        engine.record_routing(True)
        return engine.generate(prompts, params)
    engine = ContinuousEngine(copy.deepcopy(model), tok, seed=1, autocast_dtype=torch.bfloat16)
    engine.record_routing(True)
    server, _ = start_in_thread(create_app(engine, model_name="moe"))
    remote = RemoteEngine([server.url], pad_id=tok.pad_token_id, routed_experts="ask")
    try:
        return remote.generate(prompts, params)
    finally:
        remote.close()
        server.stop()
        engine.close()


def mismatch(base: str, where: str = "local") -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.algorithms.losses import behaviour_weights
    from tokenmill.health.mismatch import mismatch_stats
    from tokenmill.training import LocalBackend, collate
    from tokenmill.training.router_replay import trainer_routes
    from tokenmill.types import Sample, SamplingParams, StopReason

    model, tok = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    prompts = [[5 + i, 6 + i, 7, 8 + i, 9] for i in range(12)]
    out = sample(model, tok, prompts, SamplingParams(n=8, max_tokens=20, temperature=1.0), where)
    samples = [Sample(tokens=tuple(p) + c.token_ids, loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                      logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="", completion=c.text,
                      stop_reason=StopReason.STOP, routes=c.routes)
               for p, group in zip(prompts, out, strict=True) for c in group]
    batch = collate(samples, [1.0] * len(samples), tok.pad_token_id)
    trained = batch.weights_B_T > 0
    with torch.no_grad():
        own = trainer_routes(model, batch, 8192)
    known = (batch.routes_B_T_R >= 0).all(-1) & trained
    k = model.config.num_experts_per_tok
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


def digit_share(prompts, completions, **_):
    """The learning run's reward: the share of digits in each completion (TRL's batched signature)."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def learning(out: Path, steps: int) -> dict[str, dict[str, float]]:
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl
    from tokenmill.recipes.tiny import build_tiny_moe_model

    base = build_tiny_moe_model(out / "base", **MOE)
    rows = out / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}:"}) + "\n" for i in range(256)))
    result = {}
    for mode in ("off", "r3"):
        t0 = time.time()
        cfg = load_config(RLConfig, {
            "model": {"path": base}, "data": {"path": str(rows), "num_eval": 0},
            "rewards": [{"function": f"{Path(__file__).resolve()}:digit_share"}],
            "generation": {"group_size": 8, "max_tokens": 8, "temperature": 1.0},
            "training": {"learning_rate": 1e-3, "router_replay": mode},
            "controller": {"steps": steps, "prompts_per_step": 8},
            "tracking": {"output_dir": str(out / mode), "console": "none"}, "checkpoint": {"every": 0},
        })
        run = build_run(cfg)
        try:
            run_rl(run)
        finally:
            run.close()
        metrics = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
        result[mode] = {"steps": len(rewards), "reward_first5": sum(rewards[:5]) / 5,
                        "reward_last5": sum(rewards[-5:]) / 5, "seconds": round(time.time() - t0, 1)}
        print(mode, result[mode])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--engine", choices=["local", "served"], default="local",
                        help="sample in process, or through tokenmill serve on loopback (mismatch only)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        from tokenmill.recipes.tiny import build_tiny_moe_model

        table = mismatch(build_tiny_moe_model(Path(tmp) / "moe", **MOE), args.engine)
        print(f"{'replay':8} {'mean_abs':>9} {'max_abs':>8} {'kl':>9} {'icepop':>7} {'binary_kl':>9}")
        for mode in ("off", "r2", "r3"):
            r = table[mode]
            print(f"{mode:8} {r['mismatch/mean_abs']:9.2e} {r['mismatch/max_abs']:8.3f} {r['mismatch/kl']:9.2e} "
                  f"{r['icepop_masked_frac']:7.4f} {r['binary_kl_masked_frac']:9.4f}")
        print(f"tokens whose expert set differs in some layer: {table['routing']['expert_set_differs_frac']:.3f}")
        result = {"mismatch": table}
        if not args.skip_learning and args.engine == "local":
            result["learning"] = learning(Path(tmp), args.steps)
    where = RESULTS if args.engine == "local" else RESULTS.with_name("router_replay_served.json")
    where.parent.mkdir(exist_ok=True)
    where.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
