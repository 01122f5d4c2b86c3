"""tokenmill vs TRL's GRPOTrainer: the same tiny model, data and settings, one run, one machine.

    python benchmarks/vs_trl.py                 # 200 steps, 1000 held-out problems
    python benchmarks/vs_trl.py --quick         # 30 steps, 200 held-out problems (smoke test)
    python benchmarks/vs_trl.py --steps 1500 --out benchmarks/results/vs_trl_1500.json
    python benchmarks/vs_trl.py --decode-only --out benchmarks/results/decode_8x8.json --prompts 8

The parent process builds the shared tiny model once (a random-init Llama with the character tokenizer, then a
short supervised warm start on the addition task; cached in --workdir), then runs each trainer in its own
child process (`vs_trl.py tokenmill|trl --spec ... --result ...`), so peak RSS is measured per trainer. Both
children use the same evaluation code (`tokenmill.controller.evaluate.evaluate`, greedy, outside the timed
region) before and after training.

Timed region = the training steps only:
  tokenmill: sum of `timing_s/step` from metrics.jsonl (sample prompts, generate, score, advantages, update,
             sync; the periodic logging and the evaluations are outside it)
  TRL:       sum over steps of on_step_begin -> on_step_end (generation, scoring, loss, backward, optimiser
             step; fetching the batch from the data loader and the per-step logging are outside it)
Tokens: generated = completion tokens sampled (EOS included, as both trainers train on it); trained =
generated + prompt tokens of every sequence (the sequences each trainer's update is given).

The rules this follows (the same work, the peer configured at its best, ratios reported) are in
benchmarks/README.md, "How comparisons are run". The pieces live in benchmarks/vs_trl_parts/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vs_trl_parts import baton
from vs_trl_parts.children import child_tokenmill, child_trl
from vs_trl_parts.decode import compare_decode, print_decode
from vs_trl_parts.measure import current_rss_mib, peak_rss_mib
from vs_trl_parts.report import full_curve, print_report, summarise, time_to_accuracy

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


def run_child(kind: str, spec_path: Path, result_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fn = {"tokenmill": child_tokenmill, "trl": child_trl}[kind]
    result = fn(spec)
    result["peak_rss_mib"] = peak_rss_mib()
    result["rss_end_mib"] = current_rss_mib()
    result_path.write_text(json.dumps(result, indent=1, default=str))
    turn = baton.Baton.of_child(spec.get("interleave", 0))
    if turn is not None:
        turn.done()


# ------------------------------------------------------------------------------------------ parent process


def prepare_model(spec: dict[str, Any], sft_steps: int, rebuild: bool) -> dict[str, Any]:
    """Random-init tiny Llama + character tokenizer, then a supervised warm start; cached by its settings."""
    model_dir = Path(spec["model_dir"])
    stamp = model_dir / "warm_start.json"
    wanted = {
        "hidden_size": spec["hidden_size"],
        "num_layers": spec["num_layers"],
        "sft_steps": sft_steps,
        "slip": spec["slip"],
        "seed": spec["seed"],
        "num_train": spec["num_train"],
        "num_eval": spec["num_eval"],
    }
    if not rebuild and stamp.exists() and json.loads(stamp.read_text()).get("settings") == wanted:
        print(f"reusing warm-started model {model_dir}", flush=True)
        return json.loads(stamp.read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.data.registry import task_splits
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.training.sft import run_sft

    base = Path(spec["workdir"]) / "base_model"
    build_tiny_model(base, hidden_size=spec["hidden_size"], num_layers=spec["num_layers"], seed=spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the quickstart's warm start: a sloppy teacher forgets the carry in `slip` of the carry problems
    rows, _, _ = task_splits("addition", spec["num_train"], spec["num_eval"], seed=spec["seed"], slip=spec["slip"])
    print(f"supervised warm start: {sft_steps} steps on {len(rows)} addition rows (slip {spec['slip']}) ...",
          flush=True)
    start = time.perf_counter()
    losses = run_sft(model, tokenizer, rows, steps=sft_steps, seed=spec["seed"], output_dir=model_dir)
    info = {
        "settings": wanted,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_seconds": time.perf_counter() - start,
        "sft_final_nll": losses[-1],
    }
    stamp.write_text(json.dumps(info, indent=1))
    print(f"warm start done in {info['sft_seconds']:.0f}s, final nll {losses[-1]:.3f}", flush=True)
    return info


def _child(kind: str, spec_path: Path, workdir: Path) -> tuple[list[str], dict[str, str], Path]:
    """A child's command, environment and result path (an old result removed)."""
    result_path = workdir / f"result_{kind}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE), kind, "--spec", str(spec_path), "--result", str(result_path)]
    return cmd, dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore"), result_path


def _result(kind: str, code: int, result_path: Path, start: float) -> dict[str, Any]:
    if code != 0 or not result_path.exists():
        raise SystemExit(f"{kind} child failed with exit code {code}")
    result = json.loads(result_path.read_text())
    result["wall_seconds_process"] = time.perf_counter() - start
    return result


def launch(kind: str, spec_path: Path, workdir: Path) -> dict[str, Any]:
    cmd, env, result_path = _child(kind, spec_path, workdir)
    print(f"\n=== {kind}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, check=False)
    return _result(kind, proc.returncode, result_path, start)


def launch_interleaved(kinds: list[str], spec_path: Path, workdir: Path) -> dict[str, dict[str, Any]]:
    """Both children at once, taking turns by blocks of steps (`vs_trl_parts.baton`); the first of `kinds`
    has the first turn."""
    procs, pipes, paths = {}, {}, {}
    start = time.perf_counter()
    for kind in kinds:
        cmd, env, paths[kind] = _child(kind, spec_path, workdir)
        print(f"\n=== {kind} (interleaved): {' '.join(cmd[1:])}", flush=True)
        child_env, child_fds, pipes[kind] = baton.child_env(env)
        procs[kind] = subprocess.Popen(cmd, env=child_env, pass_fds=child_fds)
        for fd in child_fds:
            os.close(fd)
    turns = baton.take_turns(procs, pipes, kinds[0])
    baton.finish(procs, pipes)
    print(f"{len(turns)} turns", flush=True)
    return {kind: _result(kind, procs[kind].returncode, paths[kind], start) | {"turns": turns.count(kind)}
            for kind in kinds}



def run_parent(args: argparse.Namespace) -> None:
    if args.quick:
        args.steps = args.steps or 30
        args.eval_rows = args.eval_rows or 200
    steps = args.steps or 200
    eval_rows = args.eval_rows or 1000
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "workdir": str(workdir),
        "model_dir": str(
            workdir / f"warm_h{args.hidden}_l{args.layers}_sft{args.sft_steps}_slip{args.slip}_s{args.seed}"
        ),
        "slip": args.slip,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_train": 20000,
        "num_eval": 1000,
        "eval_rows": eval_rows,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "learning_rate": args.lr,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "steps": steps,
        "seed": args.seed,
        "threads": args.threads,
        "eval_every": args.eval_every,
        "fast_decode": not args.no_fast_decode,
        "placement": args.placement,
        "max_staleness": 0 if args.placement == "colocated" else 1,
        "interleave": args.interleave,
    }
    if args.interleave and args.placement != "colocated":
        raise SystemExit("--interleave needs --placement colocated: an engine beside the trainer keeps generating "
                         "while the other trainer has its turn")
    if eval_rows > spec["num_eval"]:
        raise SystemExit(f"--eval-rows {eval_rows} exceeds the {spec['num_eval']} held-out problems")
    model_info = prepare_model(spec, args.sft_steps, args.rebuild)
    if args.decode_only:
        decode = compare_decode(spec)
        print_decode(spec, decode)
        write_report(args.out, {"spec": spec, "model": model_info, "machine": machine(), "decode": decode})
        return
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))

    kinds = args.order.split(",")
    if spec["interleave"]:
        results = launch_interleaved(kinds, spec_path, workdir)
    else:
        results = {kind: launch(kind, spec_path, workdir) for kind in kinds}
    tm, tr = results["tokenmill"], results["trl"]
    summary = {"tokenmill": summarise(tm), "trl": summarise(tr)}
    keys = [
        "s_per_step_median",
        "s_per_step_min",
        "s_per_step_max",
        "train_seconds",
        "generated_tok_s",
        "trained_tok_s",
        "peak_rss_mib",
        "eval_acc_after",
    ]
    ratios = {k: summary["tokenmill"][k] / summary["trl"][k] if summary["trl"][k] else None for k in keys}
    curves = {"tokenmill": full_curve(tm), "trl": full_curve(tr)}
    if args.eval_every:
        target = args.target_acc
        if target is None:  # the lower of the two best accuracies reached after the start
            target = min(max(c["accuracy"] for c in curves[k] if c["step"] > 0) for k in curves)
        tta = {k: time_to_accuracy(curves[k], target) for k in curves}
        summary["time_to_accuracy"] = {"target": target, **tta}
        if tta["tokenmill"] is not None and tta["trl"]:
            ratios["time_to_accuracy"] = tta["tokenmill"] / tta["trl"]
    report = {
        "spec": spec,
        "model": model_info,
        "machine": machine(),
        "summary": summary,
        "ratios": ratios,
        "eval_curves": curves,
        "tokenmill": tm,
        "trl": tr,
    }
    print_report(spec, report)
    write_report(args.out, report)


def machine() -> dict[str, Any]:
    """Where the numbers were measured (the load average at the end says how busy the machine was)."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def write_report(out_arg: str, report: dict[str, Any]) -> None:
    """`report` as JSON at `out_arg` (relative paths: under the repository)."""
    out = Path(out_arg)
    if not out.is_absolute():
        out = REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"results written to {out}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("tokenmill", "trl"):
        child = argparse.ArgumentParser(prog=f"vs_trl.py {argv[0]}")
        child.add_argument("--spec", required=True, type=Path)
        child.add_argument("--result", required=True, type=Path)
        a = child.parse_args(argv[1:])
        run_child(argv[0], a.spec, a.result)
        return
    if argv and argv[0] == "run":
        argv = argv[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=None, help="training steps for both (default 200; 30 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 30 steps, 200 held-out problems")
    p.add_argument(
        "--eval-rows", type=int, default=None, help="held-out problems (default 1000; 200 with --quick)"
    )
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny model")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny model")
    p.add_argument("--sft-steps", type=int, default=700, help="supervised warm-start steps (batch 64)")
    p.add_argument(
        "--slip", type=float, default=0.6,
        help="share of carry problems whose warm-start demonstration forgets the carry (as the quickstart)",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (16 = the quickstart)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate every N steps (outside the timed region) for time-to-accuracy; 0 = off",
    )
    p.add_argument(
        "--target-acc",
        type=float,
        default=None,
        help="accuracy for the time-to-accuracy row (default: the lower of the two best accuracies)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    p.add_argument("--no-fast-decode", action="store_true",
                   help="tokenmill decodes through the transformers forward (engine.fast_decode: false)")
    p.add_argument("--placement", choices=["colocated", "thread", "worker"], default="colocated",
                   help="tokenmill's engine.placement; thread / worker: generation in a producer thread / a worker "
                        "process, one step off-policy (controller.max_staleness 1); a worker's memory is counted "
                        "in tokenmill's peak RSS")
    p.add_argument("--decode-only", action="store_true",
                   help="no training: tokenmill's engine with fast decode on and off, interleaved generate() calls")
    p.add_argument("--order", default="tokenmill,trl", help="order the children run in")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="run both trainers at once, taking turns by blocks of N steps (both meet the same "
                        "machine; vs_trl_parts/baton.py); 0 = one after the other")
    p.add_argument(
        "--workdir", default="/tmp/tokenmill_vs_trl", help="models and run folders (warm start cached)"
    )
    p.add_argument("--rebuild", action="store_true", help="rebuild the warm-started model even if cached")
    p.add_argument("--out", default="benchmarks/results/vs_trl.json", help="JSON results path")
    args = p.parse_args(argv)
    if sorted(args.order.split(",")) != ["tokenmill", "trl"]:
        p.error("--order must name tokenmill and trl once each")
    run_parent(args)


if __name__ == "__main__":
    main()
