"""Continuous batching: 32 concurrent requests of mixed lengths against answering them one at a time.

    python benchmarks/continuous_batching.py                 # both model sizes, 3 repeats (~1-2 min)
    python benchmarks/continuous_batching.py --requests 64 --repeats 5

Requests have prompts of 2..40 characters and max_tokens of 8..64 (deterministic), are sampled at
temperature 1 and may stop early at end-of-sequence (a 25th of the vocabulary counts as one, so lengths
vary as they do in practice). One torch thread. Through the ContinuousEngine and the server every request
has its own seed, so those schedules generate exactly the same tokens; the HFEngine ones draw other samples
(compare tokens/s there). Schedules, each on the same requests:

- serial:        one request at a time through the ContinuousEngine (submit, wait, next)
- hf-serial:     one request at a time through HFEngine.generate (the batch engine, no loop thread)
- hf-static:     HFEngine.generate over all requests at once with the longest max_tokens (a static batch:
                 every row runs until the longest is done; what a loop without per-request limits does)
- continuous:    all requests from their own threads, arrivals staggered over ~2 ms, through the engine
- http-serial / http-continuous: the same two through `tokenmill serve`'s app on a loopback uvicorn

Printed per model: median seconds, generated tokens/s, and each schedule's speed-up over `serial`.
Results go to benchmarks/results/continuous_batching.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.server.app import create_app
from tokenmill.serving import BackgroundServer
from tokenmill.testing import build_tiny_model
from tokenmill.types import SamplingParams

SIZES = {"tiny-32x1 (unit-test model)": {"hidden_size": 32, "num_layers": 1},
         "tiny-128x2 (quickstart size)": {"hidden_size": 128, "num_layers": 2}}


def requests_for(tokenizer, count: int) -> list[tuple[list[int], int]]:
    prompts = [tokenizer("".join("0123456789+=ab"[(i * 7 + k) % 14] for k in range(2 + (i * 11) % 39)),
                         add_special_tokens=False)["input_ids"] for i in range(count)]
    return [(p, 8 + (i * 17) % 57) for i, p in enumerate(prompts)]


def run_schedules(path: str, count: int) -> dict[str, tuple[float, int]]:
    """One pass of every schedule: name -> (seconds, generated tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = list(range(7, len(tokenizer), 25))
    requests = requests_for(tokenizer, count)
    out: dict[str, tuple[float, int]] = {}
    pool = ThreadPoolExecutor(count)
    list(pool.map(lambda _: None, range(2 * count)))  # threads exist before any clock runs

    def timed(name: str, fn) -> None:
        start = time.perf_counter()
        completions = fn()
        out[name] = (time.perf_counter() - start, sum(len(c.token_ids) for c in completions))

    hf = HFEngine(model, tokenizer, seed=0)
    hf.generate([requests[0][0]], SamplingParams(max_tokens=2))
    timed("hf-serial", lambda: [hf.generate([p], SamplingParams(max_tokens=m))[0][0] for p, m in requests])
    longest = max(m for _, m in requests)
    timed("hf-static", lambda: [g[0] for g in hf.generate([p for p, _ in requests],
                                                           SamplingParams(max_tokens=longest))])
    with ContinuousEngine(model, tokenizer, seed=0) as engine:
        engine.generate([requests[0][0]], SamplingParams(max_tokens=2))
        timed("serial", lambda: [engine.submit(p, SamplingParams(max_tokens=m), seed=i).result(600)[0]
                                 for i, (p, m) in enumerate(requests)])

        def client(i: int):
            time.sleep(0.0003 * (i % 8))
            p, m = requests[i]
            return engine.submit(p, SamplingParams(max_tokens=m), seed=i).result(600)[0]

        timed("continuous", lambda: list(pool.map(client, range(count))))
        server = serve_in_thread(create_app(engine, model_name="bench"))
        http = httpx.Client(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=count))

        def ask(i: int):
            p, m = requests[i]
            choice = http.post("/v1/completions", json={"prompt": p, "max_tokens": m, "seed": i}).json()["choices"][0]
            return _Ids(choice["token_ids"])

        ask(0)
        timed("http-serial", lambda: [ask(i) for i in range(count)])
        timed("http-continuous", lambda: list(pool.map(ask, range(count))))
        http.close()
        server.stop()
    pool.shutdown()
    return out


def serve_in_thread(app) -> BackgroundServer:
    """uvicorn on a loopback port in a thread. The socket says IPPROTO_TCP so that asyncio turns Nagle off:
    with proto 0 every answer on a kept-alive connection waits ~40 ms for a delayed ACK."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = BackgroundServer(uvicorn.Config(app, log_level="warning", access_log=False), sock)
    server.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    server.thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark server did not start within 30 s")
        time.sleep(0.01)
    return server


class _Ids:
    def __init__(self, ids: list[int]) -> None:
        self.token_ids = ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "continuous_batching.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, size in SIZES.items():
            path = build_tiny_model(Path(tmp) / label.split()[0], seed=0, **size)
            runs = [run_schedules(path, args.requests) for _ in range(args.repeats)]
            rows = {}
            for name in runs[0]:
                seconds = statistics.median(r[name][0] for r in runs)
                tokens = statistics.median(r[name][1] for r in runs)
                rows[name] = {"seconds": round(seconds, 4), "tokens": tokens, "tokens_per_s": round(tokens / seconds)}
            base = rows["serial"]["seconds"]
            for name, row in rows.items():
                row["speedup_vs_serial"] = round(base / row["seconds"], 2)
            results[label] = rows
            print(f"\n{label}: {args.requests} requests, median of {args.repeats}, 1 torch thread")
            print(f"  {'schedule':<16}{'seconds':>9}{'tokens':>8}{'tok/s':>8}{'vs serial':>11}")
            for name, row in rows.items():
                print(f"  {name:<16}{row['seconds']:>9.3f}{row['tokens']:>8.0f}{row['tokens_per_s']:>8}"
                      f"{row['speedup_vs_serial']:>10.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"requests": args.requests, "repeats": args.repeats,
                                          "torch_threads": 1, "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
