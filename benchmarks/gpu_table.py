"""The GPU table: engine decode, trainer throughput and one GRPO step against TRL, on a model shaped like
Qwen3-0.6B (random init from its config: nothing is downloaded; throughput does not depend on the weights).

1. decode: tokens/s of `HFEngine.generate` (128-token prompts, 256 new tokens, bf16 weights) at batch 1, 32
   and 256, with the decode step compiled (`torch.compile`) and replayed from a CUDA graph, replayed
   uncompiled, run eagerly, and through the transformers forward; next to the memory-bandwidth bound: a
   step must read every weight once and each row's
   key/value cache, so tokens/s <= batch x bandwidth / (weight bytes + batch x mean context x KV bytes per
   token). The bandwidth is measured here (a device-to-device copy, bytes read plus written).
2. train: tokens/s of one optimiser step (`LocalBackend.forward_backward` + `optim_step`: fp32 master
   weights, bf16 autocast, the PPO-clip loss, chunked logprobs and entropy) over 64K tokens in rows of 4K
   and of 16K tokens, and the model FLOPs utilisation: (6 x matmul parameters + 6 x layers x sequence x
   attention width) FLOPs per token over the chip's dense bf16 peak (989 TFLOP/s for the H100 and H200 SXM).
3. grpo: whole GRPO steps (generate, score, update) of `tokenmill.train` and of TRL's `GRPOTrainer` on the
   same model folder, prompts and reward: 8 prompts x 8 samples x 256 new tokens, bf16 autocast on both.
   The reward is a checksum of the completion's token ids (every group has spread, so both trainers do
   the whole update); the first step is warm-up, the table shows the median of the rest.

    python benchmarks/gpu_table.py                              # CUDA: all parts -> results/gpu_table.json
    python benchmarks/gpu_table.py --small --device cpu         # the same code on a tiny model (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_trl_parts

QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}
SMALL = QWEN3_0_6B | {"vocab_size": 2000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
PEAK_BF16_FLOPS = 989.4e12  # dense bf16, H100 SXM and H200 (the same tensor cores)
PROMPT_TOKENS, NEW_TOKENS = 128, 256


def build_model(shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tokenmill.recipes.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "random init left non-finite weights"
    return model.eval(), tok


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 10 * 2 * src.numel() * 4 / (time.perf_counter() - start)


def decode_part(args, shape: dict) -> dict:
    from tokenmill.engines import HFEngine
    from tokenmill.types import SamplingParams

    model, tok = build_model(shape, torch.bfloat16, args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    bandwidth = copy_bandwidth(args.device) if args.device.startswith("cuda") else None
    rng = random.Random(0)
    prompts = [[rng.randrange(7, len(tok)) for _ in range(PROMPT_TOKENS)] for _ in range(max(args.batches))]
    rows, reference = [], {}
    for variant in args.variants:
        if "graphs" in variant and not args.device.startswith("cuda"):
            continue
        engine = HFEngine(model, tok, seed=0, fast_decode=variant != "transformers",
                          cuda_graphs="graphs" in variant, compile_step=variant == "compiled_graphs")
        for batch in args.batches:
            if variant == "transformers" and batch not in args.transformers_batches:
                continue
            # warm-up at the timed length: compiling, the allocator, and the per-shape plans (cuDNN attention)
            # that a process builds once, which would otherwise fall on whichever variant is timed first
            warm = time.perf_counter()
            engine.generate(prompts[:batch], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0))
            warm = time.perf_counter() - warm
            engine.generator.manual_seed(1)
            sync(args.device)
            start = time.perf_counter()
            out = engine.generate(prompts[:batch], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0))
            sync(args.device)
            seconds = time.perf_counter() - start
            ids = [c.token_ids for group in out for c in group]
            tokens = sum(len(t) for t in ids)
            row = {"variant": variant, "batch": batch, "tokens": tokens, "seconds": round(seconds, 4),
                   "tokens_per_s": round(tokens / seconds, 1), "ms_per_step": round(1000 * seconds / NEW_TOKENS, 3)}
            if bandwidth:
                kv = batch * (PROMPT_TOKENS + NEW_TOKENS / 2) * engine.kv_bytes_per_token()
                bound = batch * bandwidth / (weight_bytes + kv)
                row |= {"bound_tokens_per_s": round(bound, 1), "fraction_of_bound": round(tokens / seconds / bound, 4)}
            if variant in ("fast_eager", "compiled_graphs"):  # same seed: the uncompiled graphs' tokens?
                same = [a == b for a, b in zip(reference.get(batch, []), ids)]
                row["cuda_graph_rows_equal"] = f"{sum(same)}/{len(same)}" if same else None
            else:
                reference.setdefault(batch, ids)
            if engine._graphed is not None:
                row["graph_recordings"] = engine._graphed.recordings
                if variant == "compiled_graphs":
                    row |= {"warmup_seconds": round(warm, 2), "compile_off": engine._graphed.compile_off,
                            "compile_seconds": round(engine._graphed.compile_seconds, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}


def profile_part(args, shape: dict) -> dict:
    """Where a decode step's time goes: `torch.profiler` over 64 new tokens at each batch size, with the
    engine's default path (CUDA graphs on a GPU); the top operators by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.engines import HFEngine
    from tokenmill.types import SamplingParams

    model, tok = build_model(shape, torch.bfloat16, args.device)
    engine = HFEngine(model, tok, seed=0)
    rng = random.Random(0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    out = {}
    for batch in args.batches:
        prompts = [[rng.randrange(7, len(tok)) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        engine.generate(prompts, SamplingParams(max_tokens=8))
        sync(args.device)
        with profile(activities=activities) as prof:
            engine.generate(prompts, SamplingParams(max_tokens=64))
            sync(args.device)
        events = prof.key_averages()
        top = {}
        for key in ("self_cpu_time_total", "self_device_time_total"):
            rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:12]
            top[key] = [{"op": e.key, "count": e.count, "ms": round(getattr(e, key, 0) / 1000, 2)} for e in rows]
        out[f"batch_{batch}"] = top
        print(f"batch {batch}:", json.dumps(top["self_cpu_time_total"][:8]), flush=True)
        print(f"batch {batch} device:", json.dumps(top["self_device_time_total"][:6]), flush=True)
    return out


def train_flops_per_token(model, seq: int) -> float:
    c = model.config
    embedding = model.get_input_embeddings().weight.numel()
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embedding  # projections + MLPs
    matmul += embedding  # the (tied) head is a matmul of the embedding's size
    attention = 6 * c.num_hidden_layers * seq * c.num_attention_heads * c.head_dim  # QK^T, AV; causal: half
    return 6 * matmul + attention


def train_part(args, shape: dict) -> dict:
    from tokenmill.algorithms.losses import LOSSES
    from tokenmill.training.batch import Batch
    from tokenmill.training.local import LocalBackend

    cuda = args.device.startswith("cuda")
    model, _ = build_model(shape, torch.float32, args.device)
    backend = LocalBackend(model, learning_rate=1e-6, total_steps=100, micro_batch_tokens=max(args.seq_lens),
                           autocast_dtype=torch.bfloat16 if cuda else None)
    ppo = LOSSES["ppo_clip"]

    def loss(logprobs_B_T, micro):
        return ppo(logprobs_B_T, old_logprobs_B_T=micro.old_logprobs_B_T, advantages=micro.advantages,
                   weights_B_T=micro.weights_B_T, clip_low=0.2, clip_high=0.2, ref_logprobs_B_T=None,
                   kl_coef=0.0, kl_estimator="k3")

    rows = []
    for seq in args.seq_lens:
        count = max(1, args.train_tokens // seq)
        gen = torch.Generator().manual_seed(seq)
        batch = Batch(
            input_ids_B_T=torch.randint(7, shape["vocab_size"], (count, seq), generator=gen),
            lengths_B=torch.full((count,), seq), weights_B_T=torch.full((count, seq), 1.0 / (count * seq)),
            old_logprobs_B_T=torch.full((count, seq), -float(torch.log(torch.tensor(shape["vocab_size"])))),
            advantages_B=torch.randn(count, generator=gen),
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        try:
            for _ in range(1 + args.train_steps):  # the first is warm-up
                sync(args.device)
                start = time.perf_counter()
                backend.forward_backward(batch, loss)
                backend.optim_step()
                sync(args.device)
                times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as exc:
            rows.append({"seq_len": seq, "error": f"out of memory: {str(exc)[:200]}"})
            continue
        seconds = statistics.median(times[1:])
        tok_s = count * seq / seconds
        row = {"seq_len": seq, "rows": count, "tokens_per_step": count * seq, "step_seconds": round(seconds, 4),
               "tokens_per_s": round(tok_s, 1), "flops_per_token": train_flops_per_token(model, seq)}
        if cuda:
            row["mfu"] = round(tok_s * row["flops_per_token"] / PEAK_BF16_FLOPS, 4)
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"peak_bf16_flops": PEAK_BF16_FLOPS, "rows": rows}


def id_checksum_reward(completion_ids=None, **_) -> list[float]:
    """A reward with spread on any model, random ones included: a checksum of the completion's token ids."""
    return [(sum(ids) % 1009) / 1009 for ids in completion_ids]


def write_model_dir(shape: dict, path: Path, device: str) -> str:
    model, tok = build_model(shape, torch.float32, device)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def grpo_spec(args, workdir: Path) -> dict:
    return {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": NEW_TOKENS, "steps": 1 + args.grpo_steps,
            "temperature": 1.0, "learning_rate": 1e-6, "max_grad_norm": 1.0, "beta": 0.0, "seed": 0,
            "eval_every": 0, "eval_rows": 1, "num_train": 64, "num_eval": 0, "threads": torch.get_num_threads(),
            "workdir": str(workdir), "device": args.device, "bf16": args.device.startswith("cuda")}


def tokenmill_grpo(spec: dict, model_dir: str, prompts: str, compile_step: bool = True,
                   overlap: bool = False) -> dict:
    from vs_trl_parts.children import tokenmill_config

    import tokenmill

    out = Path(spec["workdir"]) / f"tokenmill_run_{int(compile_step)}{int(overlap)}"
    cfg = tokenmill_config(spec | {"model_dir": model_dir}, str(out))
    cfg["model"] |= {"dtype": "auto", "device": spec["device"]}
    cfg.setdefault("engine", {})["compile_step"] = compile_step
    if overlap:  # one-step off-policy: the engine thread generates the next batch during the update
        cfg["engine"]["placement"] = "thread"
        cfg["controller"]["max_staleness"] = 1
    cfg["data"] = {"path": prompts, "num_eval": 0, "shuffle": True}
    cfg["rewards"] = [{"function": f"{Path(__file__).resolve()}:id_checksum_reward", "timeout_s": 60}]
    tokenmill.train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "timing_s/step" in r]
    seqs = spec["prompts_per_step"] * spec["group_size"]
    return {"step_seconds": [r["timing_s/step"] for r in steps],
            "generated_per_step": [round(seqs * r["response_len/mean"]) for r in steps],
            "stage_seconds": [{k[len("timing_s/"):]: round(v, 3) for k, v in r.items() if k.startswith("timing_s/")}
                              for r in steps]}


def trl_grpo(spec: dict, model_dir: str, prompts: str) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer
    from vs_trl_parts.children import step_timer, trl_args

    seen = {"generated": 0}

    def checksum(prompts=None, completions=None, completion_ids=None, **_):
        seen["generated"] += sum(len(ids) for ids in completion_ids)
        return id_checksum_reward(completion_ids=completion_ids)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = step_timer(spec, seen, tokenizer, None)
    trainer = GRPOTrainer(model=model, reward_funcs=[checksum], args=trl_args(spec, spec["workdir"] + "/trl_run"),
                          train_dataset=load_dataset("json", data_files=prompts, split="train"),
                          processing_class=tokenizer, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {"step_seconds": timer.step_seconds, "generated_per_step": timer.generated_per_step}


def grpo_part(args, shape: dict) -> dict:
    import trl

    workdir = Path(tempfile.mkdtemp(prefix="gpu_table_"))
    model_dir = write_model_dir(shape, workdir / "model", args.device)
    rng = random.Random(0)
    prompts = workdir / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(64):
            a, b = rng.randrange(10**6), rng.randrange(10**6)
            f.write(json.dumps({"prompt": f"Add the numbers {a} and {b}, then show each step of the sum: "}) + "\n")
    spec = grpo_spec(args, workdir)
    out = {"spec": {k: v for k, v in spec.items() if k != "workdir"}, "trl_version": trl.__version__}
    runs = {"tokenmill": tokenmill_grpo, "tokenmill_uncompiled": partial(tokenmill_grpo, compile_step=False),
            "tokenmill_async": partial(tokenmill_grpo, overlap=True), "trl": trl_grpo}
    for name in args.grpo_runs:
        run = runs[name]
        try:
            result = run(spec, model_dir, str(prompts))
            timed = result["step_seconds"][1:]
            tokens = sum(result["generated_per_step"][1:])
            result |= {"median_step_seconds": round(statistics.median(timed), 3),
                       "generated_tokens_per_s": round(tokens / sum(timed), 1)}
        except Exception as exc:  # noqa: BLE001 - the other trainer's numbers are still worth keeping
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        out[name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k != "traceback"})[:1500], flush=True)
    for name in ("tokenmill", "tokenmill_uncompiled", "tokenmill_async"):
        if "median_step_seconds" in out.get(name, {}) and "median_step_seconds" in out.get("trl", {}):
            speedup = out["trl"]["median_step_seconds"] / out[name]["median_step_seconds"]
            out["step_speedup_vs_trl" + name[len("tokenmill"):]] = round(speedup, 2)
    return out


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "commit": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or None}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "multiprocessors": props.multi_processor_count}
    import transformers

    return info | {"transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model of the same family (smoke run)")
    parser.add_argument("--parts", default="decode,train,grpo", help="any of decode,train,grpo,profile")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--variants", nargs="+", default=["cuda_graphs", "compiled_graphs", "fast_eager", "transformers"])
    parser.add_argument("--transformers-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--train-tokens", type=int, default=65536)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--grpo-runs", nargs="+", default=["tokenmill", "tokenmill_uncompiled", "trl"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_table.json"))
    args = parser.parse_args()
    shape = SMALL if args.small else QWEN3_0_6B
    report = {"machine": machine(args.device), "shape": shape}
    parts = {"decode": decode_part, "train": train_part, "grpo": grpo_part, "profile": profile_part}
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            report[name] = parts[name](args, shape)
        except Exception as exc:  # noqa: BLE001 - keep the parts that ran
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(report[name]["traceback"], flush=True)
        report[name]["part_seconds"] = round(time.perf_counter() - start, 1)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


def print_table(report: dict) -> None:
    print("\n| part | setting | tokens/s | notes |\n| --- | --- | --- | --- |")
    for row in report.get("decode", {}).get("rows", []):
        note = f"{row.get('fraction_of_bound', 0):.0%} of bound {row.get('bound_tokens_per_s')}" \
            if "bound_tokens_per_s" in row else ""
        print(f"| decode {row['variant']} | batch {row['batch']} | {row['tokens_per_s']} | {note} |")
    for row in report.get("train", {}).get("rows", []):
        print(f"| train | seq {row['seq_len']} | {row.get('tokens_per_s', row.get('error'))} | "
              f"MFU {row.get('mfu')} peak {row.get('peak_memory_gib')} GiB |")
    grpo = report.get("grpo", {})
    for name in ("tokenmill", "tokenmill_uncompiled", "tokenmill_async", "trl"):
        r = grpo.get(name, {})
        print(f"| grpo step | {name} | {r.get('generated_tokens_per_s', r.get('error', '')[:80])} | "
              f"median step {r.get('median_step_seconds')} s |")
    print("step speed-up vs TRL:", {k: v for k, v in grpo.items() if k.startswith("step_speedup")})


if __name__ == "__main__":
    main()
