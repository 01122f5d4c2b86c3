"""Weight sync to an engine server in another process: after a push (files or gloo broadcast, SGLang or vLLM
route shapes) the server computes the trainer's logprobs within 1e-4 (fp32) and reports the pushed version;
bad pushes are refused naming the tensor, and the server keeps serving its old weights."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tokenmill.sync import (
    BroadcastSync,
    FileSync,
    InProcessSync,
    WeightSync,
    WeightSyncError,
    merged_lora_weights,
)

PROMPT = [5, 9, 14, 3, 22, 7, 11, 30, 2, 17, 8, 25]

TOKEN = "sync-test-token"


class Server:
    """`tokenmill serve MODEL --port 0` in its own process (a ContinuousEngine behind the OpenAI routes and
    the weight routes), with a bearer token."""

    def __init__(self, model_path: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", model_path, "--port", "0", "--token", TOKEN,
             "--served-model-name", "tiny"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        match = re.search(r"ready on (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, f"server did not start: {line!r}"
        self.url = match.group(1)
        self.http = httpx.Client(timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})

    def version(self) -> int:
        return self.http.get(self.url + "/health").json()["policy_version"]

    def sample(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """Sampled completion ids of `prompt` and the server's logprobs of them (OpenAI completions route)."""
        answer = self.http.post(self.url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "logprobs": 1,
            "return_token_ids": True,
        }).json()
        choice = answer["choices"][0]
        return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path)
    yield s
    s.stop()


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logprobs of `ids[1:]` under the trainer's model."""
    t = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=t).logits[0, :-1].float(), -1)
    return logp.gather(-1, t[0, 1:, None])[:, 0]


def perturb(model, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def logprob_gap(server: Server, model) -> float:
    """Largest difference between the server's logprobs of a completion it sampled and the trainer's
    teacher-forced logprobs of the same tokens."""
    ids, server_lp = server.sample(PROMPT)
    assert ids, "the server sampled nothing"
    trainer_lp = trainer_logprobs(model, PROMPT + ids)[len(PROMPT) - 1:]
    return (server_lp - trainer_lp).abs().max().item()


def assert_in_sync(server: Server, model, version: int) -> None:
    for _ in range(2):
        gap = logprob_gap(server, model)
        assert gap < 1e-4, f"server logprobs differ from the trainer's by {gap}"
    assert server.version() == version


def assert_out_of_sync(server: Server, model) -> None:
    assert logprob_gap(server, model) > 1e-2


# -------------------------------------------------------------------------------------------------- files
def test_file_push_matches_trainer(server, tiny_model, tmp_path):
    sync = FileSync([server.url], tmp_path / "weights", token=TOKEN)
    assert isinstance(sync, WeightSync)
    try:
        for step in (1, 2):
            version = server.version() + 1
            perturb(tiny_model, seed=step)
            assert_out_of_sync(server, tiny_model)
            sync.push(trainable(tiny_model), version)
            assert_in_sync(server, tiny_model, version)
        # only the latest folder stays on disk
        assert [p.name for p in (tmp_path / "weights").iterdir()] == [f"v{version:08d}"]
    finally:
        sync.close()


def test_files_send_only_what_is_pushed(server, tiny_model, tmp_path):
    """A partial push (one tensor) changes only that tensor on the server."""
    sync = FileSync([server.url], tmp_path / "w", token=TOKEN)
    try:
        sync.push(trainable(tiny_model), server.version() + 1)  # start equal
        name, p = "model.norm.weight", dict(tiny_model.named_parameters())["model.norm.weight"]
        with torch.no_grad():
            p.mul_(1.5)
        version = server.version() + 1
        sync.push([(name, p)], version)
        assert_in_sync(server, tiny_model, version)
    finally:
        sync.close()


# -------------------------------------------------------------------------------------------------- broadcast
@pytest.mark.parametrize(("api", "bucket_bytes"), [("sglang", 0), ("vllm", 0), ("sglang", 1 << 20), ("sglang", 5000)])
def test_broadcast_push_matches_trainer(server, tiny_model, api, bucket_bytes):
    """One broadcast per tensor, or packed into buckets: one, or several of at most 5,000 bytes (the tiny
    model's tensors are 128 B to 16 KiB: small ones share a bucket, large ones go alone)."""
    sync = BroadcastSync([server.url], api=api, backend="gloo", timeout_s=20, token=TOKEN, bucket_bytes=bucket_bytes)
    assert isinstance(sync, WeightSync)
    try:
        for step in (3, 4):
            version = server.version() + 1
            perturb(tiny_model, seed=step + (10 if api == "vllm" else 0) + bucket_bytes % 97)
            assert_out_of_sync(server, tiny_model)
            sync.push(trainable(tiny_model), version)
            assert_in_sync(server, tiny_model, version)
    finally:
        sync.close()


# -------------------------------------------------------------------------------------------------- refusals
def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return server.http.post(server.url + path, json=body)


def test_bad_disk_updates_are_refused_and_old_weights_kept(server, tiny_model, tmp_path):
    from safetensors.torch import save_file

    FileSync([server.url], tmp_path / "start", token=TOKEN).push(trainable(tiny_model), server.version() + 1)
    version = server.version()
    r = _post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "is not a folder" in r.json()["message"]
    good = {n: p.detach() + 1.0 for n, p in trainable(tiny_model)}  # would change the outputs if applied
    cases = {
        "model.layers.0.mlp.up_proj.weight": ("shape [3, 3]", torch.zeros(3, 3)),
        "model.norm.weight": ("dtype torch.float64", torch.zeros(32, dtype=torch.float64)),
        "model.no_such.weight": ("no such parameter", torch.zeros(2)),
    }
    for i, (name, (why, bad)) in enumerate(cases.items()):
        folder = tmp_path / f"bad{i}"
        folder.mkdir()
        save_file({**good, name: bad}, str(folder / "model.safetensors"))
        r = _post(server, "/update_weights_from_disk", {"model_path": str(folder), "policy_version": 99})
        assert r.status_code == 400, r.text
        assert r.json()["success"] is False and name in r.json()["message"] and why in r.json()["message"]
        assert r.json()["policy_version"] == version
    # nothing was copied: not even the good tensors that came before the bad one
    assert_in_sync(server, tiny_model, version)
    # the sync raises with the server's reason
    sync = FileSync([server.url], tmp_path / "s", dtype=torch.float64, token=TOKEN)
    with pytest.raises(WeightSyncError, match=r"refused \(HTTP 400\).*dtype torch.float64"):
        sync.push(trainable(tiny_model), version + 1)
    sync.close()
    assert server.version() == version


@pytest.mark.parametrize("bucket_bytes", [0, 5000])
def test_bad_broadcast_is_refused_and_the_group_stays_usable(server, tiny_model, bucket_bytes):
    sync = BroadcastSync([server.url], timeout_s=20, token=TOKEN, bucket_bytes=bucket_bytes)
    try:
        version = server.version() + 1
        sync.push(trainable(tiny_model), version)
        before = copy.deepcopy(tiny_model)
        perturb(tiny_model, seed=7)
        named = trainable(tiny_model)
        bad = [*named[:-1], (named[-1][0], torch.zeros(2, 2))]  # last tensor: wrong shape, received then refused
        with pytest.raises(WeightSyncError, match=rf"{named[-1][0]!r}: shape \[2, 2\]"):
            sync.push(bad, version + 1)
        assert_in_sync(server, before, version)
        sync.push(named, version + 1)  # same group, next push lands
        assert_in_sync(server, tiny_model, version + 1)
    finally:
        sync.close()


def test_a_push_without_the_token_is_refused(server, tiny_model, tmp_path):
    with pytest.raises(WeightSyncError, match="HTTP 401"):
        FileSync([server.url], tmp_path / "w").push(trainable(tiny_model), 77)
    assert server.version() != 77


def test_bad_control_calls_name_the_field(server):
    r = _post(server, "/update_weights_from_distributed",
              {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert r.status_code == 400 and "group_name 'nope'" in r.json()["message"]
    r = _post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                     "rank_offset": 1, "world_size": 2, "backend": "mpi"})
    assert r.status_code == 400 and "backend" in r.json()["message"]
    r = _post(server, "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []},
                                          "surprise": 1})
    assert r.status_code == 400 and "surprise" in r.text, r.text


def test_a_server_that_never_joins_fails_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="127.0.0.1:9"):
        BroadcastSync(["http://127.0.0.1:9"], timeout_s=2)  # nothing listens on the discard port
    assert time.monotonic() - t0 < 10


# -------------------------------------------------------------------------------------------------- LoRA
def test_lora_pushes_merged_weights(server, tiny_model_path, tiny_model, tmp_path):
    from tokenmill.config.schema import LoRAConfig, ModelConfig
    from tokenmill.training import LocalBackend
    from tokenmill.training.model import load_policy

    model, _ = load_policy(ModelConfig(path=tiny_model_path, lora=LoRAConfig(rank=4)), torch.device("cpu"))
    backend = LocalBackend(model, learning_rate=1e-2, total_steps=1)
    with torch.no_grad():
        for _, p in backend.weights():
            p.add_(0.1)  # B != 0: the adapters change the outputs
    sync = FileSync([server.url], tmp_path / "lora", token=TOKEN)
    try:
        sync.push(tiny_model.named_parameters(), 49)  # the server back on the base weights (earlier tests moved it)
        with pytest.raises(WeightSyncError, match="LoRA adapter.*merged_lora_weights"):
            sync.push(backend.weights(), 50)
        merged = dict(merged_lora_weights(model))
        assert merged and not any("lora" in n or "base_layer" in n for n in merged)
        sync.push(merged.items(), 50)
        assert_in_sync(server, model, 50)
    finally:
        sync.close()


def test_inprocess_sync_copies_into_the_engine(tiny_model, tokenizer):
    from tokenmill.engines.local.hf import HFEngine

    engine = HFEngine(copy.deepcopy(tiny_model), tokenizer)
    perturb(tiny_model, seed=5)
    sync = InProcessSync(engine)
    assert isinstance(sync, WeightSync)
    sync.push(trainable(tiny_model), 3)
    torch.testing.assert_close(trainer_logprobs(engine.model, PROMPT), trainer_logprobs(tiny_model, PROMPT))
    assert engine.version == 3


# -------------------------------------------------------------------------------------------------- faults
def test_two_servers_then_one_dies(server, tiny_model_path, tiny_model, tmp_path):
    """Both servers get each push; once one is dead a strict sync raises naming it, and a `drop_failed` one
    drops it and the survivor still gets the push (broadcast: the group re-formed without the dead rank)."""
    doomed = Server(tiny_model_path)
    urls = [server.url, doomed.url]
    syncs = {  # two groups on one server need two names
        "broadcast strict": BroadcastSync(urls, timeout_s=10, group_name="strict", token=TOKEN),
        "broadcast tolerant": BroadcastSync(urls, timeout_s=10, drop_failed=True, token=TOKEN),
        "files strict": FileSync(urls, tmp_path / "strict", token=TOKEN),
        "files tolerant": FileSync(urls, tmp_path / "tolerant", drop_failed=True, token=TOKEN),
    }
    try:
        for i, name in enumerate(["broadcast tolerant", "files strict"]):
            version = server.version() + 1
            perturb(tiny_model, seed=40 + i)
            syncs[name].push(trainable(tiny_model), version)
            assert_in_sync(server, tiny_model, version)
            assert_in_sync(doomed, tiny_model, version)
        doomed.stop()
        for i, method in enumerate(["files", "broadcast"]):
            version = server.version() + 1
            perturb(tiny_model, seed=50 + i)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match=doomed.url):
                syncs[f"{method} strict"].push(trainable(tiny_model), version)
            syncs[f"{method} tolerant"].push(trainable(tiny_model), version)
            assert time.monotonic() - t0 < 30
            assert syncs[f"{method} tolerant"].servers.urls == [server.url]
            assert_in_sync(server, tiny_model, version)
    finally:
        for sync in syncs.values():
            sync.close()


def test_a_server_dropped_by_the_sync_is_never_routed_to_again(server, tiny_model_path, tiny_model, tmp_path):
    """A server that misses a push (here: frozen with SIGSTOP past the sync's timeout) is dropped by a tolerant
    sync and misses the next push too; once it answers again it is healthy but holds older weights, so the
    engine's pool must not bring it back on a health probe, and every later request goes to the server that
    took the push."""
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.types import SamplingParams

    laggard = Server(tiny_model_path)
    sync = FileSync([server.url, laggard.url], tmp_path / "w", drop_failed=True, timeout_s=3, token=TOKEN)
    engine = RemoteEngine([server.url, laggard.url], pad_id=0, token=TOKEN, timeout_s=30, cooldown_s=0, sync=sync,
                          model="tiny")
    params = SamplingParams(max_tokens=3, n=2, temperature=1.0)
    try:
        for _ in range(3):
            engine.generate([[5, 6, 7]] * 4, params)
        assert engine.pool.stats()[laggard.url]["served"] > 0  # both servers take requests at first
        os.kill(laggard.proc.pid, signal.SIGSTOP)
        try:
            for seed in (77, 78):  # the first push times out on the laggard, the second goes to the other alone
                version = server.version() + 1
                perturb(tiny_model, seed=seed)
                engine.update_weights(trainable(tiny_model), version)
        finally:
            os.kill(laggard.proc.pid, signal.SIGCONT)
        assert sync.servers.urls == [server.url]
        assert_in_sync(server, tiny_model, version)
        assert laggard.version() < version  # alive and healthy again, but on its old weights
        assert engine.pool.probe() == {server.url: True, laggard.url: False}
        served = engine.pool.stats()[laggard.url]["served"]
        for _ in range(3):
            engine.generate([[5, 6, 7]] * 4, params)
        stats = engine.pool.stats()[laggard.url]
        assert stats["served"] == served and stats["retired"] and not stats["up"]
    finally:
        engine.close()
        laggard.stop()
