"""Weight sync to Ray engine replicas: files vs broadcast from the trainer ranks (`cluster.weight_sync`).

    python benchmarks/ray_weight_sync.py                      # quickstart and a 25M-parameter model (~3 min)
    python benchmarks/ray_weight_sync.py --models 25M --repeats 3

A local loopback Ray cluster with 2 FSDP2 trainer ranks (gloo) and 2 `tokenmill serve` replicas, each one Ray
actor, as `tokenmill train` starts them. Each push is timed end to end, as a run pays it after an update:

- files: rank 0 gathers the full weights and sends them through the object store to the driver, which copies
  them into its model, writes a safetensors folder and has both replicas load it (`RayBackend.weights()` +
  `FileSync`);
- broadcast: the ranks gather, rank 0 broadcasts packed buckets to both replicas and the driver
  (`controller.ray.weights.RankBroadcastSync`).

Interleaved, `--repeats` times each; the medians and files / broadcast are printed and written to
benchmarks/results/ray_weight_sync.json. After the pushes, both replicas' weights are checked equal
(`torch.equal`) to the ranks' (`/get_weights_by_name`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tokenmill.recipes.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weight_sync  # the in-process benchmark beside this one: its model shapes and its row

MODELS = {name: weight_sync.MODELS[name] for name in ("quickstart", "25M")}
sync_row = weight_sync.sync_row


def _check(urls: list[str], want: dict[str, torch.Tensor]) -> None:
    for url in urls:
        for name, tensor in want.items():
            rows = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": tensor.shape[0]},
                              timeout=120).json()
            if not torch.equal(torch.tensor(rows, dtype=tensor.dtype), tensor):
                raise AssertionError(f"{url}: {name} differs from the trainer's after the pushes")


def bench_model(cluster, name: str, shape: dict, repeats: int, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.controller.ray.weights import RankBroadcastSync, RankWeights
    from tokenmill.controller.ray.workers import BackendSpec, RayBackend, WorkerGroup
    from tokenmill.sync import FileSync
    from tokenmill.training.spec import TrainerSpec

    path = build_tiny_model(workdir / name, **shape)
    spec = BackendSpec(path, str(workdir / f"{name}-shards"), trainer=TrainerSpec(learning_rate=1e-3, total_steps=1))
    group = WorkerGroup(cluster, spec, 2, start_timeout_s=600)
    fleet = EngineFleet(cluster, path, 2, cpus=1, threads=1, start_timeout_s=600)
    mirror = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    files = FileSync(fleet.urls, workdir / f"{name}-push", timeout_s=600)
    broadcast = RankBroadcastSync(group, fleet.urls, mirror, timeout_s=600)
    gather = RayBackend(group, mirror=mirror)
    times: dict[str, list[float]] = {"files": [], "broadcast": []}
    version = 0
    try:
        for _ in range(repeats + 1):  # the first round opens the group and warms up: not counted
            for method, spent in times.items():
                version += 1
                t0 = time.perf_counter()
                if method == "files":
                    files.push(gather.weights(), version)
                else:
                    broadcast.push(RankWeights(gather), version)
                if version > 2:
                    spent.append(time.perf_counter() - t0)
        _check(fleet.urls, dict(gather.gathered_weights()))
    finally:
        files.close()
        broadcast.close()
        fleet.close()
        group.close()
    params = sum(p.numel() for p in mirror.parameters())
    return sync_row({"model": name, "params": params, "replicas": 2, "trainer_ranks": 2}, mirror, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "ray_weight_sync.json"))
    args = parser.parse_args()
    from tokenmill.controller.ray.cluster import connect, set_local_env

    set_local_env()
    torch.set_num_threads(1)
    cluster = connect(None, num_cpus=6, call_timeout_s=600, start_timeout_s=600)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                rows.append(bench_model(cluster, name, MODELS[name], args.repeats, Path(tmp)))
                r = rows[-1]
                print(f"{r['model']:>10}: {r['params'] / 1e6:7.2f}M params {r['mb']:8.2f} MB to 2 replicas | files "
                      f"{r['files_s'] * 1e3:8.1f} ms | broadcast {r['broadcast_s'] * 1e3:8.1f} ms "
                      f"({r['broadcast_mb_per_s']:7.1f} MB/s) | files/broadcast {r['files_over_broadcast']:.2f}x",
                      flush=True)
    finally:
        cluster.close()
    out = Path(args.output)
    out.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
