"""Everything of "keep the GPU fed" in one run on one GPU, one JSON: what a short GPU loan measures.

Parts (each under a share of `--budget-s`, default 540 s = 9 minutes on one H100; a part or case that would
run past it is recorded as skipped, and the JSON is written after every part):

1. decode: tokens/s of the in-process engine and its fraction of the memory-bandwidth bound at batch 1, 32
   and 256 (`benchmarks/paged_decode.py`'s `run_decode_bench` where that file is there, else
   `gpu_table.decode_part` with the default path: the compiled step in a CUDA graph).
2. train: trainer tokens/s and MFU at 4K and 16K tokens per row, activation checkpointing off and on (stated
   per row), FLOPs counted as tokenmill does and as prime-rl does (`tokenmill.training.mfu`), liger-kernel's
   fused ops where installed, and a `torch.profiler` table per sequence length: what limits MFU.
3. grpo: whole GRPO steps of 8 prompts x 8 samples x 256 new tokens, tokenmill against TRL's GRPOTrainer
   (`gpu_table.grpo_part`).
4. largest: the largest Qwen3-shaped model (0.6B, 1.7B, 4B, 8B) that runs a GRPO step of 8 x 8 x 1,024 tokens
   on this device, full fine-tuning and LoRA (rank 16, every linear layer): generate, release the engine's
   memory, update; peak memory measured beside `tokenmill estimate`'s prediction. Where the estimate finds
   the configured micro-batch too large but a smaller one fitting, the step uses that one (what the run's
   refusal advises); a case that fits at no micro-batch is not run (the run would be refused the same way).
5. async: `engine.placement: thread` (one-step off-policy) against the ideal max(generate, train) of the
   synchronous run, over 20 steps each (`ratio`), and against its own stages (`own_ratio`: on a shared
   machine the two runs meet different loads).

    python benchmarks/gpu_suite.py --commit $(git rev-parse --short HEAD)   # one GPU -> results/gpu_suite.json
    python benchmarks/gpu_suite.py --small --device cpu                    # the same code, tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_table  # the decode bench, model builder, GRPO harness and machine description

GIB = 2**30
QWEN3 = {  # the dense Qwen3 family's shapes (their config.json), random-init here
    "Qwen3-0.6B": gpu_table.QWEN3_0_6B,
    "Qwen3-1.7B": gpu_table.QWEN3_0_6B | {"hidden_size": 2048, "intermediate_size": 6144},
    "Qwen3-4B": gpu_table.QWEN3_0_6B | {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                                        "num_attention_heads": 32},
    "Qwen3-8B": gpu_table.QWEN3_0_6B | {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                        "num_attention_heads": 32, "tie_word_embeddings": False},
}
TINY = {"tiny-64": gpu_table.SMALL, "tiny-128": gpu_table.SMALL | {"hidden_size": 128, "intermediate_size": 256,
                                                                     "num_hidden_layers": 3}}
SETTINGS = {
    "full": {"decode_batches": [1, 32, 256], "decode_new": 256, "prompt_tokens": 128, "grpo_new": 256,
             "grpo_steps": 3, "train_seqs": [4096, 16384], "train_tokens": 65536, "train_steps": 2,
             "table_new": 1024, "table_micro_tokens": 16384, "async_steps": 20, "async_new": 256,
             "budgets": {"decode": 130, "train": 100, "grpo": 110, "largest": 110, "async": 90}},
    # the same code on tiny shapes; nothing is skipped for time (a shared CPU's speed says nothing)
    "small": {"decode_batches": [1, 4], "decode_new": 8, "prompt_tokens": 16, "grpo_new": 8, "grpo_steps": 2,
              "train_seqs": [256, 1024], "train_tokens": 2048, "train_steps": 1, "table_new": 16,
              "table_micro_tokens": 1024, "async_steps": 20, "async_new": 4,
              "budgets": {"decode": 3600, "train": 3600, "grpo": 3600, "largest": 3600, "async": 3600}},
}
PARTS = ("decode", "train", "grpo", "largest", "async")
TARGETS = {"decode_fraction_256": 0.50, "decode_fraction_32": 0.35, "decode_tokens_per_s_1": 800,
           "grpo_step_seconds": 1.5, "grpo_speedup_vs_trl": 5.0, "mfu_16k": 0.30, "mfu_4k": 0.25,
           "async_ratio": 1.15}


class Clock:
    """The suite's deadline and each part's share of it."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part(self, share_s: float) -> float:
        """The monotonic time a part given `share_s` seconds must stop starting new cases at."""
        return min(self.deadline, time.monotonic() + share_s)


def sync(device: str) -> None:
    gpu_table.sync(device)


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if device.startswith("cuda") else None


# --- 1. decode ------------------------------------------------------------------------------------------------


def _paged_bench():
    """`run_decode_bench(model, batch_sizes, new_tokens, device) -> dict` of benchmarks/paged_decode.py, if there."""
    if importlib.util.find_spec("paged_decode") is None:
        return None
    import paged_decode

    return getattr(paged_decode, "run_decode_bench", None)


def decode_part(args, cfg: dict, shape: dict, stop_at: float) -> dict:
    """gpu_table's decode bench (the static cache: the compiled step in a CUDA graph on a GPU, the bound per
    batch), then the paged cache's variants of benchmarks/paged_decode.py over the same prompt and completion
    lengths, each row's fraction of that batch's bound; `by_batch` keeps the fastest variant per batch."""
    gpu_table.PROMPT_TOKENS, gpu_table.NEW_TOKENS = cfg["prompt_tokens"], cfg["decode_new"]
    cuda = args.device.startswith("cuda")
    ns = SimpleNamespace(device=args.device, batches=cfg["decode_batches"], transformers_batches=[],
                         variants=["compiled_graphs"] if cuda else ["fast_eager"])
    out = gpu_table.decode_part(ns, shape)
    by_batch = {r["batch"]: {"variant": r["variant"], "tokens_per_s": r["tokens_per_s"],
                             "fraction_of_bound": r.get("fraction_of_bound")} for r in out["rows"]}
    paged, bench = None, _paged_bench()
    if bench is None:
        paged = {"skipped": "benchmarks/paged_decode.py not present"}
    elif time.monotonic() > stop_at:
        paged = {"skipped": "over the part's time budget"}
    else:
        model, tok = gpu_table.build_model(shape, torch.bfloat16, args.device)
        variants = ("static", "paged_flex", "paged_device") if cuda else ("static", "paged_gather", "paged_device")
        try:
            paged = bench(model, cfg["decode_batches"], cfg["decode_new"], args.device, tokenizer=tok,
                          prompt_tokens=cfg["prompt_tokens"], variants=variants, repeats=1)
        except Exception as exc:  # noqa: BLE001 - the static rows stand; say why the paged ones are missing
            paged = {"error": f"{type(exc).__name__}: {exc}"}
        del model
        for row in paged.get("rows", []):
            bound = next((r.get("bound_tokens_per_s") for r in out["rows"] if r["batch"] == row["batch"]), None)
            if bound:
                row["fraction_of_bound"] = round(row["tokens_per_s"] / bound, 4)
            best = by_batch.get(row["batch"])
            if row.get("samples_per_prompt", 1) == 1 and (best is None or row["tokens_per_s"] > best["tokens_per_s"]):
                by_batch[row["batch"]] = {k: row.get(k) for k in ("variant", "tokens_per_s", "fraction_of_bound")}
    return {"source": "gpu_table.decode_part + benchmarks/paged_decode.py run_decode_bench", "result": out,
            "paged": paged, "by_batch": by_batch}


# --- 2. train: MFU --------------------------------------------------------------------------------------------


def _train_batch(vocab: int, seq: int, rows: int):
    from tokenmill.training.batch import Batch

    gen = torch.Generator().manual_seed(seq)
    return Batch(input_ids_B_T=torch.randint(7, vocab, (rows, seq), generator=gen), lengths_B=torch.full((rows,), seq),
                 weights_B_T=torch.full((rows, seq), 1.0 / (rows * seq)),
                 old_logprobs_B_T=torch.full((rows, seq), -float(torch.log(torch.tensor(float(vocab))))),
                 advantages_B=torch.randn(rows, generator=gen))


def ppo_loss(logprobs_B_T, micro):
    from tokenmill.algorithms.losses import LOSSES

    return LOSSES["ppo_clip"](logprobs_B_T, old_logprobs_B_T=micro.old_logprobs_B_T, advantages=micro.advantages,
                              weights_B_T=micro.weights_B_T, clip_low=0.2, clip_high=0.2, ref_logprobs_B_T=None,
                              kl_coef=0.0, kl_estimator="k3")


def _time_steps(backend, batch, steps: int, device: str) -> list[float]:
    times = []
    for _ in range(1 + steps):  # the first is warm-up
        sync(device)
        start = time.perf_counter()
        backend.forward_backward(batch, ppo_loss)
        backend.optim_step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def _profile_step(backend, batch, device: str) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        backend.forward_backward(batch, ppo_loss)
        backend.optim_step()
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:12]
    total = sum(getattr(e, key, 0) for e in prof.key_averages()) or 1
    return [{"op": e.key, "count": e.count, "ms": round(getattr(e, key, 0) / 1000, 2),
             "share": round(getattr(e, key, 0) / total, 3)} for e in events]


def train_variants(device: str) -> list[dict]:
    variants = [{"activation_checkpointing": False, "kernels": "none"},
                {"activation_checkpointing": True, "kernels": "none"}]
    if device.startswith("cuda") and importlib.util.find_spec("liger_kernel") is not None:
        variants.append({"activation_checkpointing": False, "kernels": "liger"})
    return variants


def train_part(args, cfg: dict, shape: dict, stop_at: float) -> dict:
    from tokenmill.training.local import LocalBackend
    from tokenmill.training.mfu import mfu, peak_flops

    cuda = args.device.startswith("cuda")
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else None
    rows, profiles = [], {}
    for variant in train_variants(args.device):
        model, _ = gpu_table.build_model(shape, torch.float32, args.device)
        for seq in cfg["train_seqs"]:
            if time.monotonic() > stop_at:
                rows.append({"seq_len": seq, **variant, "skipped": "time budget"})
                continue
            backend = LocalBackend(model, learning_rate=1e-6, total_steps=100, micro_batch_tokens=seq,
                                   autocast_dtype=torch.bfloat16 if cuda else None, **variant)
            count = max(1, cfg["train_tokens"] // seq)
            batch = _train_batch(shape["vocab_size"], seq, count)
            _peak_reset(args.device)
            try:
                seconds = statistics.median(_time_steps(backend, batch, cfg["train_steps"], args.device))
            except torch.OutOfMemoryError as exc:
                rows.append({"seq_len": seq, **variant, "error": f"out of memory: {str(exc)[:160]}"})
                continue
            tok_s = count * seq / seconds
            row = {"seq_len": seq, "rows": count, **variant, "step_seconds": round(seconds, 4),
                   "tokens_per_s": round(tok_s, 1), "peak_memory_gib": _peak_gib(args.device)}
            if peak:
                row["mfu"] = {k: round(v, 4) for k, v in mfu(model.config, seq, tok_s, peak).items()}
            rows.append(row)
            print("train", json.dumps(row), flush=True)
            if variant == train_variants(args.device)[0] and time.monotonic() < stop_at:
                profiles[f"seq_{seq}"] = _profile_step(backend, batch, args.device)
            del backend
        del model
        _peak_reset(args.device)
    return {"peak_bf16_flops": peak, "flops": "tokenmill: 6 x matmul params + 6 x layers x seq x heads x head_dim "
            "(causal half); prime_rl: the same with 12 (every key)", "rows": rows, "profile": profiles}


# --- 3. one GRPO step against TRL -----------------------------------------------------------------------------


def grpo_part(args, cfg: dict, shape: dict, stop_at: float) -> dict:
    gpu_table.NEW_TOKENS = cfg["grpo_new"]
    ns = SimpleNamespace(device=args.device, grpo_steps=cfg["grpo_steps"], grpo_runs=["tokenmill", "trl"])
    return gpu_table.grpo_part(ns, shape)


# --- 4. the largest model one GPU trains -----------------------------------------------------------------------


def table_config(folder: Path, cfg: dict, lora: bool, device_type: str) -> dict:
    """The run the table's step stands for, as `tokenmill estimate` reads it (8 x 8 x `table_new` tokens)."""
    return {"model": {"path": str(folder), "device": device_type, "lora": {"rank": 16 if lora else 0}},
            "data": {"task": "addition"}, "controller": {"prompts_per_step": 8},
            "generation": {"group_size": 8, "max_tokens": cfg["table_new"]},
            "training": {"micro_batch_tokens": cfg["table_micro_tokens"]},
            "estimate": {"prompt_tokens": cfg["prompt_tokens"], "logprobs": "chunked"}}


def estimated_peak(shape: dict, cfg: dict, lora: bool, device_type: str, memory: int, workdir: Path) -> dict:
    from dataclasses import replace

    from transformers import Qwen3Config

    from tokenmill.estimate.config import plan_from_config
    from tokenmill.estimate.memory import estimate, solve_budget

    folder = workdir / f"shape_{shape['hidden_size']}_{shape['num_hidden_layers']}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(Qwen3Config(**shape).to_json_string())
    plan, _ = plan_from_config(table_config(folder, cfg, lora, device_type), device_memory_gib=memory / GIB)
    budget = solve_budget(plan)
    if not estimate(plan).device.fits and budget is not None and budget.fits:  # what the refusal would advise
        plan = replace(plan, micro_batch_tokens=budget.micro_batch * plan.seq_len)
    dev = estimate(plan).device
    # the estimate's total adds a fragmentation margin and the CUDA context; what torch allocates is the rest
    allocated = dev.persistent + max(dev.phases.values())
    return {"estimate_total_gib": round(dev.total / GIB, 2), "estimate_allocated_gib": round(allocated / GIB, 2),
            "fits_by_estimate": bool(dev.fits), "peak_phase": dev.peak_phase,
            "micro_batch_tokens": plan.micro_batch_tokens}


def grpo_step_samples(engine, prompts: list[list[int]], cfg: dict):
    """One step's rollouts as training samples (random advantages: the update's cost does not depend on them)."""
    from tokenmill.types import Sample, SamplingParams

    out = engine.generate(prompts, SamplingParams(max_tokens=cfg["table_new"], n=8, temperature=1.0))
    rng = random.Random(0)
    samples = []
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            samples.append(Sample(tokens=tuple(prompt) + c.token_ids, loss_mask=(0,) * len(prompt) + (1,) * len(c.token_ids),
                                  logprobs=(0.0,) * len(prompt) + c.logprobs, prompt_len=len(prompt), prompt="",
                                  completion="", stop_reason=c.stop_reason, advantage=rng.uniform(-1, 1)))
    return samples


def measured_step(shape: dict, cfg: dict, lora: bool, device: str, micro_batch_tokens: int | None = None) -> dict:
    """Generate 8 x 8 completions, release the engine's memory, update: seconds and peak memory."""
    from tokenmill.engines import HFEngine
    from tokenmill.training import collate
    from tokenmill.training.local import LocalBackend

    cuda = device.startswith("cuda")
    model, tok = gpu_table.build_model(shape, torch.float32, device)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    amp = torch.bfloat16 if cuda else None
    engine = HFEngine(model, tok, seed=0, autocast_dtype=amp, compile_step=False)
    rng = random.Random(1)
    prompts = [[rng.randrange(7, shape["vocab_size"]) for _ in range(cfg["prompt_tokens"])] for _ in range(8)]
    _peak_reset(device)
    start = time.perf_counter()
    samples = grpo_step_samples(engine, prompts, cfg)
    sync(device)
    generated = time.perf_counter()
    peak_generate = _peak_gib(device)
    engine.release_memory()
    backend = LocalBackend(model, learning_rate=1e-6, total_steps=1, autocast_dtype=amp,
                           micro_batch_tokens=micro_batch_tokens or cfg["table_micro_tokens"])
    batch = collate(samples, [1.0 / sum(len(s.tokens) - s.prompt_len for s in samples)] * len(samples), tok.pad_token_id)
    backend.forward_backward(batch, ppo_loss)
    backend.optim_step()
    sync(device)
    return {"generate_seconds": round(generated - start, 2), "update_seconds": round(time.perf_counter() - generated, 2),
            "peak_generate_gib": peak_generate, "peak_memory_gib": _peak_gib(device),
            "generated_tokens": sum(len(s.tokens) - s.prompt_len for s in samples)}


def largest_part(args, cfg: dict, shapes: dict, stop_at: float) -> dict:
    cuda = args.device.startswith("cuda")
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else 16 * GIB
    workdir = Path(tempfile.mkdtemp(prefix="gpu_suite_shapes_"))
    rows, largest = [], {}
    for mode in ("full", "lora"):
        for name, shape in shapes.items():
            row = {"model": name, "mode": mode} | estimated_peak(shape, cfg, mode == "lora", args.device.split(":")[0],
                                                                 memory, workdir)
            if not row["fits_by_estimate"]:
                row["result"] = "not run: the estimate says it does not fit (the run would be refused)"
            elif time.monotonic() > stop_at:
                row["result"] = "skipped: time budget"
            else:
                try:
                    row |= measured_step(shape, cfg, mode == "lora", args.device, row["micro_batch_tokens"])
                    row["result"] = "ran"
                    largest[mode] = name
                except torch.OutOfMemoryError as exc:
                    row["result"] = f"out of memory: {str(exc)[:160]}"
                _peak_reset(args.device)
                if row.get("peak_memory_gib"):
                    row["peak_over_estimate"] = round(row["peak_memory_gib"] / row["estimate_allocated_gib"], 3)
            rows.append(row)
            print("largest", json.dumps(row), flush=True)
    return {"device_memory_gib": round(memory / GIB, 1), "step": f"8 x 8 x {cfg['table_new']} tokens",
            "largest": largest, "rows": rows}


# --- 5. async on one GPU ------------------------------------------------------------------------------------


def _prompts_file(workdir: Path) -> str:
    rng = random.Random(0)
    path = workdir / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Add {rng.randrange(10**6)} and {rng.randrange(10**6)}: "}) + "\n"
                            for _ in range(64)))
    return str(path)


def overlap_ratio(sync_run: dict, async_run: dict, warmup: int = 2) -> dict:
    """The async step against the ideal max(generate, train) of the synchronous run (medians, warm-up dropped)."""
    stages = sync_run["stage_seconds"][warmup:]
    gen = statistics.median(s.get("generate", 0) + s.get("reward", 0) for s in stages)
    train = statistics.median(s.get("train", 0) + s.get("sync", 0) for s in stages)
    step = statistics.median(async_run["step_seconds"][warmup:])
    sync_step = statistics.median(sync_run["step_seconds"][warmup:])
    ideal = max(gen, train)
    return {"generate_s": round(gen, 4), "train_s": round(train, 4), "ideal_s": round(ideal, 4),
            "async_step_s": round(step, 4), "sync_step_s": round(sync_step, 4), "ratio": round(step / ideal, 3),
            "speedup_over_sync": round(sync_step / step, 3), "steps_counted": len(stages)}


def own_stages(run_dir: Path, warmup: int = 2) -> dict:
    """The async run's ratio against its own stages: the producer's generate + reward and the trainer's train +
    sync, each a median over the steps (both sides slowed by sharing the device, which the sync run is not)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "timing_s/step" in r][warmup:]
    gen = statistics.median(r.get("async/producer_generate_s", 0) + r.get("async/producer_reward_s", 0) for r in steps)
    train = statistics.median(r.get("timing_s/train", 0) + r.get("timing_s/sync", 0) for r in steps)
    step = statistics.median(r["timing_s/step"] for r in steps)
    return {"own_generate_s": round(gen, 4), "own_train_s": round(train, 4),
            "own_ratio": round(step / max(gen, train), 3)}


def async_part(args, cfg: dict, shape: dict, stop_at: float) -> dict:
    gpu_table.NEW_TOKENS = cfg["async_new"]
    workdir = Path(tempfile.mkdtemp(prefix="gpu_suite_async_"))
    model_dir = gpu_table.write_model_dir(shape, workdir / "model", args.device)
    prompts = _prompts_file(workdir)
    spec = gpu_table.grpo_spec(SimpleNamespace(device=args.device, grpo_steps=cfg["async_steps"] + 1), workdir)
    sync_run = gpu_table.tokenmill_grpo(spec, model_dir, prompts)
    if time.monotonic() > stop_at:
        return {"skipped": "time budget after the synchronous run", "sync": sync_run}
    async_run = gpu_table.tokenmill_grpo(spec, model_dir, prompts, overlap=True)
    out = {"spec": {k: v for k, v in spec.items() if k != "workdir"}, "stream": "own CUDA stream" if
           args.device.startswith("cuda") else "none (CPU)"} | overlap_ratio(sync_run, async_run)
    out |= own_stages(workdir / "tokenmill_run_11")  # gpu_table.tokenmill_grpo's folder for compiled + overlap
    out |= {"sync_step_seconds": sync_run["step_seconds"], "async_step_seconds": async_run["step_seconds"]}
    print("async", json.dumps({k: v for k, v in out.items() if not k.endswith("step_seconds")}), flush=True)
    return out


# --- the run --------------------------------------------------------------------------------------------------


def summary(report: dict) -> dict:
    """The issue's targets next to what this run measured (None where a part did not give the number)."""
    parts = report["parts"]
    decode = parts.get("decode", {}).get("by_batch", {})
    train = [r for r in parts.get("train", {}).get("rows", []) if "mfu" in r]
    best = {seq: max((r["mfu"]["tokenmill"] for r in train if r["seq_len"] == seq), default=None)
            for seq in (4096, 16384)}
    grpo = parts.get("grpo", {})
    got = {"decode_fraction_256": decode.get(256, {}).get("fraction_of_bound"),
           "decode_fraction_32": decode.get(32, {}).get("fraction_of_bound"),
           "decode_tokens_per_s_1": decode.get(1, {}).get("tokens_per_s"),
           "grpo_step_seconds": grpo.get("tokenmill", {}).get("median_step_seconds"),
           "grpo_speedup_vs_trl": grpo.get("step_speedup_vs_trl"), "mfu_4k": best[4096], "mfu_16k": best[16384],
           "async_ratio": parts.get("async", {}).get("ratio")}
    lower_is_better = {"grpo_step_seconds", "async_ratio"}
    return {k: {"target": TARGETS[k], "measured": v,
                "met": None if v is None else (v <= TARGETS[k] if k in lower_is_better else v >= TARGETS[k])}
            for k, v in got.items()}


def run_part(name: str, args, cfg: dict, clock: Clock) -> dict:
    shape = gpu_table.SMALL if args.small else gpu_table.QWEN3_0_6B
    stop_at = clock.part(cfg["budgets"][name])
    start = time.perf_counter()
    try:
        if clock.left() < 5:
            out = {"skipped": "the suite's time budget is spent"}
        elif name == "largest":
            out = largest_part(args, cfg, TINY if args.small else QWEN3, stop_at)
        else:
            out = {"decode": decode_part, "train": train_part, "grpo": grpo_part, "async": async_part}[name](
                args, cfg, shape, stop_at)
    except Exception as exc:  # noqa: BLE001 - keep the other parts' numbers
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        print(out["traceback"], flush=True)
    out["part_seconds"] = round(time.perf_counter() - start, 1)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes and lengths: the same code in seconds")
    parser.add_argument("--commit", default=None, help="the tree's commit (the GPU machine's copy has no .git)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole suite's time budget (default 540 s; with --small, none)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_suite.json"))
    args = parser.parse_args(argv)
    cfg = SETTINGS["small" if args.small else "full"]
    clock = Clock(args.budget_s if args.budget_s is not None else 36_000.0 if args.small else 540.0)
    machine = gpu_table.machine(args.device) | {"commit": args.commit}
    report = {"machine": machine, "small": args.small, "settings": cfg, "parts": {}}
    started = time.perf_counter()
    for name in args.parts.split(","):
        report["parts"][name] = run_part(name, args, cfg, clock)
        report["suite_seconds"] = round(time.perf_counter() - started, 1)
        report["targets"] = summary(report)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["targets"], indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()
