"""`vs_trl.py` run several times on one setting, the order of the two trainers alternating, and the ratios
summarised as median and spread (the table the README quotes).

    python benchmarks/vs_trl_repeats.py --repeats 3 --name 16x8 -- --steps 300 --eval-every 50
    python benchmarks/vs_trl_repeats.py --repeats 3 --name 8x8 -- --steps 300 --eval-every 50 --prompts 8

Each run's full report goes to `benchmarks/results/vs_trl_<name>_run<i>.json`, the summary to
`benchmarks/results/vs_trl_<name>_repeats.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RATIOS = ("generated_tok_s", "s_per_step_median", "train_seconds", "time_to_accuracy", "peak_rss_mib",
          "eval_acc_after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", required=True, help="names the result files")
    parser.add_argument("vs_trl_args", nargs=argparse.REMAINDER, help="after --: the arguments of vs_trl.py")
    args = parser.parse_args()
    passthrough = [a for a in args.vs_trl_args if a != "--"]
    runs = []
    for i in range(args.repeats):
        order = "tokenmill,trl" if i % 2 == 0 else "trl,tokenmill"
        out = RESULTS / f"vs_trl_{args.name}_run{i + 1}.json"
        subprocess.run([sys.executable, str(Path(__file__).parent / "vs_trl.py"), *passthrough, "--order", order,
                        "--out", str(out)], check=True)
        report = json.loads(out.read_text())
        runs.append({"order": order, "ratios": report["ratios"], "loadavg_at_end": report["machine"]["loadavg_at_end"],
                     "tokenmill_generated_tok_s": report["summary"]["tokenmill"]["generated_tok_s"],
                     "trl_generated_tok_s": report["summary"]["trl"]["generated_tok_s"]})
    summary = {}
    for key in RATIOS:
        values = [r["ratios"].get(key) for r in runs if r["ratios"].get(key) is not None]
        if values:
            summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                            "runs": values}
    result = {"args": passthrough, "repeats": args.repeats, "ratios_tokenmill_over_trl": summary, "runs": runs}
    (RESULTS / f"vs_trl_{args.name}_repeats.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{args.name}: tokenmill / TRL over {args.repeats} runs (median, min..max)")
    for key, s in summary.items():
        print(f"  {key:20s} {s['median']:.3f}  ({s['min']:.3f}..{s['max']:.3f})")


if __name__ == "__main__":
    main()
