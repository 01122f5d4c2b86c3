"""Weight-sync push time: safetensors files vs torch.distributed (gloo) broadcast, to an engine server in
another process on this machine (`tokenmill serve`).

    python benchmarks/weight_sync.py                 # tiny, quickstart and a 25M-parameter model (~1 min)

For each model: the server loads it, the trainer perturbs every weight and pushes it `--repeats` times with
each method (interleaved). Printed: parameters, MB pushed, median push seconds (write/broadcast + the
server's check and copy, until every server has answered), MB/s, and files / broadcast. Every push is
checked: the server's teacher-forced logprobs equal the trainer's within 1e-4. Results go to
benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tokenmill.recipes.tiny import build_tiny_model
from tokenmill.sync import BroadcastSync, FileSync

MODELS = {
    "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    "quickstart": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "25M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
}
PROMPT = [5, 9, 14, 3, 22, 7, 11, 30, 2, 17, 8, 25]

def start_server(path: str) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve MODEL --port 0` (ContinuousEngine, OpenAI routes, weight routes); its URL once ready."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", path, "--port", "0",
                             "--served-model-name", "bench"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    match = re.search(r"ready on (http://127\.0\.0\.1:\d+)/v1", proc.stdout.readline())
    if not match:
        proc.kill()
        raise RuntimeError("tokenmill serve did not start")
    return proc, match.group(1)


def check(url: str, model, version: int) -> None:
    """The server's logprobs of a completion it samples equal the trainer's teacher-forced ones."""
    answer = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "bench", "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "return_token_ids": True}).json()
    choice = answer["choices"][0]
    ids = torch.tensor([PROMPT + choice["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    diff = (torch.tensor(choice["logprobs"]["token_logprobs"]) - logp[len(PROMPT) - 1:]).abs().max().item()
    if diff > 1e-4 or answer["policy_version"] != version:
        raise AssertionError(f"server out of sync after push {version}: diff {diff}, "
                             f"version {answer['policy_version']}")


def bench_model(name: str, shape: dict, repeats: int, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(workdir / name, **shape)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    proc, url = start_server(path)
    times: dict[str, list[float]] = {"files": [], "broadcast": []}
    syncs = {"files": FileSync([url], workdir / f"{name}-push"), "broadcast": BroadcastSync([url], timeout_s=60)}
    version = 0
    try:
        for _ in range(repeats):
            for method, sync in syncs.items():
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3)
                t0 = time.perf_counter()
                sync.push(model.named_parameters(), version)
                times[method].append(time.perf_counter() - t0)
                check(url, model, version)
    finally:
        for sync in syncs.values():
            sync.close()
        proc.terminate()
        proc.wait(timeout=10)
    return sync_row({"model": name, "params": params}, model, times)


def sync_row(row: dict, model, times: dict[str, list[float]]) -> dict:
    """`row` plus, per method, the median push time, every time and the MB/s over `model`'s weights, and the
    files / broadcast ratio."""
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    row["mb"] = round(mb, 2)
    for method, ts in times.items():
        row[f"{method}_s"] = round(statistics.median(ts), 4)
        row[f"{method}_all_s"] = [round(t, 4) for t in ts]
        row[f"{method}_mb_per_s"] = round(mb / statistics.median(ts), 1)
    row["files_over_broadcast"] = round(row["files_s"] / row["broadcast_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(bench_model(name, MODELS[name], args.repeats, Path(tmp)))
            r = rows[-1]
            print(f"{r['model']:>10}: {r['params'] / 1e6:7.2f}M params {r['mb']:8.2f} MB | files "
                  f"{r['files_s'] * 1e3:8.1f} ms ({r['files_mb_per_s']:7.1f} MB/s) | broadcast "
                  f"{r['broadcast_s'] * 1e3:8.1f} ms ({r['broadcast_mb_per_s']:7.1f} MB/s) | files/broadcast "
                  f"{r['files_over_broadcast']:.2f}x", flush=True)
    out = Path(__file__).parent / "results" / "weight_sync.json"
    out.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
