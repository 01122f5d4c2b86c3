"""Training tokens/s of a vision-language GRPO batch packed (the default) against padded rows
(`training.share_prompts: false`), on the CPU. The tiny Qwen2.5-VL of the tiny-model kit (2 language layers
64 wide, a 2-block vision tower), prompts from the `shapes` task (one picture each), groups of G samples
with completions of random lengths; one training step is the forward and backward of every micro-batch
(`training.local.micro_token_stats`, logprobs and entropies, the weighted sum's gradient). The two layouts
alternate, each timed `--repeats` times; the median is reported. The vision tower is frozen, as a run's is
by default. tokens/s counts the batch's real tokens
(prompt and completion of every sample) in both, so it compares the same work; tokens per CPU-second (this
process's CPU time) is the steadier number on a shared machine.

    python benchmarks/vlm_packing.py [--prompts 8 --group 8 --grid 4 --threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def grpo_batch(path: str, prompts: int, group: int, grid: int, max_completion: int, seed: int):
    """A collated batch of `prompts` shapes pictures x `group` samples with random completion lengths."""
    import torch

    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.batch import collate
    from tokenmill.types import Sample, StopReason

    processor = VisionProcessor.from_pretrained(path)
    rows = shapes_dataset(prompts, seed=seed, grid=grid)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for row in rows:
        ids, inputs = processor.encode(row["prompt"], row["images"])
        for _ in range(group):
            n = int(torch.randint(4, max_completion + 1, (1,), generator=g))
            completion = torch.randint(20, 60, (n,), generator=g).tolist()
            samples.append(Sample(tokens=tuple(ids + completion), loss_mask=(0,) * len(ids) + (1,) * n,
                                  logprobs=(0.0,) * (len(ids) + n), prompt_len=len(ids), prompt=None,
                                  completion="", stop_reason=StopReason.STOP, images=inputs))
    return collate(samples, [1.0 / len(samples)] * len(samples), processor.tokenizer.pad_token_id)


def model_tokens(batch, budget: int) -> dict:
    """Tokens through the language model per layout: rows x width of every micro-batch."""
    from tokenmill.training.local import packing_segments
    from tokenmill.training.packing import micro_packs

    segments = packing_segments(batch, share_prompts=True, pack_sequences=False)
    return {"packed": sum(p.input_ids_R_L.numel() for _, p in micro_packs(batch, budget, segments)),
            "padded": sum(m.input_ids_B_T.numel() for m in batch.micro_batches(budget))}


def count_pictures(model) -> list[int]:
    """A list the vision encoder appends the number of pictures of each call to."""
    from tokenmill.engines.local.vision import vision_tower

    seen: list[int] = []

    def hook(module, args, kwargs, out):
        seen.append(int((kwargs.get("grid_thw") if "grid_thw" in kwargs else args[1]).shape[0]))

    vision_tower(model).register_forward_hook(hook, with_kwargs=True)
    return seen


def step_seconds(model, batch, *, share_prompts: bool, budget: int) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) of one training step's forward and backward."""
    from tokenmill.training.local import micro_token_stats

    model.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    for _, micro, lp, ent in micro_token_stats(model, batch, temperature=1.0, token_budget=budget, entropy=True,
                                               share_prompts=share_prompts):
        ((lp * micro.weights_B_T).sum() + 0.01 * (ent * micro.weights_B_T).sum()).backward()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--grid", type=int, default=4, help="board cells per side (16 px each): 4 = 64 x 64 px")
    parser.add_argument("--max-completion", type=int, default=32)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/vlm_packing.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText

    from tokenmill.recipes.tiny_vlm import build_tiny_vlm
    from tokenmill.training.vision import freeze_vision_tower

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        path = build_tiny_vlm(Path(work) / "tiny-vlm", hidden_size=64)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).train()
        freeze_vision_tower(model)  # as a run trains by default (model.freeze_vision)
        batch = grpo_batch(path, args.prompts, args.group, args.grid, args.max_completion, seed=0)
        times: dict[str, list[tuple[float, float]]] = {"packed": [], "padded": []}
        pictures, encoded = count_pictures(model), {}
        for layout in ("packed", "padded"):  # warm-up, counting the pictures encoded
            pictures.clear()
            step_seconds(model, batch, share_prompts=layout == "packed", budget=args.micro_batch_tokens)
            encoded[layout] = sum(pictures)
        for _ in range(args.repeats):
            for layout in ("packed", "padded"):
                times[layout].append(step_seconds(model, batch, share_prompts=layout == "packed",
                                                  budget=args.micro_batch_tokens))
    tokens = batch.num_tokens
    image_tokens = int(sum(int(x.image_grid_thw.prod(-1).sum()) // 4 for x in batch.images_B))
    result = {"samples": batch.size, "tokens": tokens, "image_tokens": image_tokens, "threads": args.threads,
              "micro_batch_tokens": args.micro_batch_tokens, "grid": args.grid}
    through = model_tokens(batch, args.micro_batch_tokens)
    for layout, runs in times.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        result[layout] = {"step_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 1),
                          "cpu_s": round(cpu, 4), "tokens_per_cpu_s": round(tokens / cpu, 1),
                          "model_tokens": through[layout], "pictures_encoded": encoded[layout],
                          "runs_s": [round(w, 4) for w, _ in runs]}
    result["speedup"] = round(result["padded"]["step_s"] / result["packed"]["step_s"], 2)
    result["cpu_speedup"] = round(result["padded"]["cpu_s"] / result["packed"]["cpu_s"], 2)
    print(f"{batch.size} samples, {tokens} tokens ({image_tokens} image tokens), {args.threads} threads")
    for layout in ("packed", "padded"):
        r = result[layout]
        print(f"{layout:>7}: {r['step_s']:.3f} s/step  {r['tokens_per_s']:>8.1f} tokens/s  "
              f"{r['tokens_per_cpu_s']:>8.1f} tokens/CPU-s  ({r['model_tokens']} tokens through the model, "
              f"{r['pictures_encoded']} pictures encoded)")
    print(f"packed is {result['speedup']}x padded (wall clock), {result['cpu_speedup']}x (CPU time)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
