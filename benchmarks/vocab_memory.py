"""Peak memory of one policy update against the vocabulary size: the full-logits path against the chunked LM
head (`training.chunked_logprobs`), at equal tokens.

    python benchmarks/vocab_memory.py                        # vocab 32,000 and 151,936, hidden 32, 2,048 tokens
    python benchmarks/vocab_memory.py --tokens 1024 --hidden 64

Each case (vocabulary x path) runs in a fresh subprocess: a random-init Llama (nothing downloaded, tied
embeddings like the small Qwen models), one GRPO-shaped batch (groups sharing a prompt), one warm-up update so
the optimiser state and the allocator are in place, then the measured update (`forward_backward` with the
PPO-clip loss and the entropy metric, then `optim_step`). Memory is the process RSS: the kernel's peak
(`VmHWM`) is reset just before the measured update (`/proc/self/clear_refs`), so `update_peak_mib` is the
peak RSS during that update minus the RSS before it. A last subprocess checks that both paths give the same
gradients at the largest vocabulary (fewer tokens, so the full-logits side fits anywhere).
Results go to benchmarks/results/vocab_memory.json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "vocab_memory.json"


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(vocab: int, hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _batch(vocab: int, tokens: int, groups: int = 4, group_size: int = 4, prompt: int = 32):
    """`groups` prompts of `prompt` tokens, each with `group_size` completions, `tokens` tokens once packed."""
    from tokenmill.algorithms import token_weights
    from tokenmill.training import collate
    from tokenmill.types import Sample, StopReason

    rng = random.Random(0)
    completion = (tokens // groups - prompt) // group_size
    samples = []
    for _ in range(groups):
        p = [rng.randrange(3, vocab) for _ in range(prompt)]
        for _ in range(group_size):
            c = [rng.randrange(3, vocab) for _ in range(completion)]
            samples.append(Sample(tokens=tuple(p + c), loss_mask=(0,) * prompt + (1,) * completion,
                                  logprobs=(0.0,) * prompt + tuple(-rng.uniform(8, 13) for _ in c), prompt_len=prompt,
                                  prompt="p", completion="c", stop_reason=StopReason.STOP,
                                  advantage=rng.uniform(-1, 1)))
    return collate(samples, token_weights([completion] * len(samples), "token_mean"), pad_id=0)


def _loss():
    from tokenmill.config import AlgorithmConfig
    from tokenmill.training.update import _batch_loss

    return _batch_loss("ppo_clip", AlgorithmConfig())


def case(vocab: int, chunked: bool, hidden: int, layers: int, tokens: int) -> dict:
    """One measured update in this (fresh) process."""
    import torch

    from tokenmill.training import LocalBackend

    torch.set_num_threads(1)
    model = _model(vocab, hidden, layers)
    batch = _batch(vocab, tokens)
    backend = LocalBackend(model, learning_rate=1e-4, total_steps=2, micro_batch_tokens=2 * tokens,
                           logits_chunk_mib=64 if chunked else 0)
    loss = _loss()
    backend.forward_backward(batch, loss)  # warm-up: optimiser state, allocator
    backend.optim_step()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_mib("VmRSS")
    metrics = backend.forward_backward(batch, loss)
    backend.optim_step()
    peak = _status_mib("VmHWM")
    params = sum(p.numel() for p in model.parameters())
    return {"vocab": vocab, "path": "chunked" if chunked else "full_logits", "tokens": tokens,
            "trained_tokens": int((batch.weights_B_T > 0).sum()), "hidden": hidden, "layers": layers,
            "parameters": params, "rss_before_mib": round(before, 1), "update_peak_mib": round(peak - before, 1),
            "process_peak_mib": round(peak, 1), "loss": metrics["loss"]}


def gradients(vocab: int, hidden: int, layers: int, tokens: int) -> dict:
    """Max gradient difference, chunked vs full logits, relative to each tensor's largest entry."""
    import torch

    from tokenmill.training import LocalBackend

    torch.set_num_threads(1)
    batch = _batch(vocab, tokens, groups=2, group_size=2, prompt=8)
    grads = {}
    for chunk in (0, 4 * vocab * 16 / 2**20):  # 16 positions per chunk: many chunks
        model = _model(vocab, hidden, layers)
        LocalBackend(model, learning_rate=1e-4, total_steps=1, logits_chunk_mib=chunk).forward_backward(batch, _loss())
        grads[chunk > 0] = {n: p.grad for n, p in model.named_parameters()}
    worst = max(float((grads[True][n] - g).abs().max() / g.abs().max().clamp_min(1.0)) for n, g in grads[False].items())
    return {"vocab": vocab, "tokens": tokens, "max_grad_diff_relative": worst}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="32000,151936")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the update (packed)")
    p.add_argument("--grad-tokens", type=int, default=96, help="tokens of the gradient check")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--case", nargs=2, metavar=("VOCAB", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--grad-check", type=int, metavar="VOCAB", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--tokens", str(args.tokens)]
    if args.case:
        print(json.dumps(case(int(args.case[0]), args.case[1] == "chunked", args.hidden, args.layers, args.tokens)))
        return
    if args.grad_check:
        print(json.dumps(gradients(args.grad_check, args.hidden, args.layers, args.grad_tokens)))
        return
    vocabs = [int(v) for v in args.vocabs.split(",")]
    rows = []
    for vocab in vocabs:
        for path in ("full_logits", "chunked"):
            rows.append(_child(["--case", str(vocab), path, *shape]))
            r = rows[-1]
            print(f"vocab {vocab:>7,} {path:<12} update peak {r['update_peak_mib']:>8.1f} MiB "
                  f"(process peak {r['process_peak_mib']:.0f} MiB, {r['parameters']:,} parameters)", flush=True)
    grad = _child(["--grad-check", str(max(vocabs)), *shape, "--grad-tokens", str(args.grad_tokens)])
    peak = {(r["vocab"], r["path"]): r["update_peak_mib"] for r in rows}
    lo, hi = min(vocabs), max(vocabs)
    summary = {
        "chunked_peak_ratio_large_vs_small_vocab": round(peak[hi, "chunked"] / peak[lo, "chunked"], 3),
        "full_logits_peak_ratio_large_vs_small_vocab": round(peak[hi, "full_logits"] / peak[lo, "full_logits"], 3),
        "chunked_vs_full_logits_at_largest_vocab": round(peak[hi, "chunked"] / peak[hi, "full_logits"], 3),
        "max_grad_diff_relative": grad["max_grad_diff_relative"],
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "cases": rows, "gradient_check": grad,
                                          "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
