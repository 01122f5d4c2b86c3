"""A distillation teacher behind a real `tokenmill serve` process on loopback gives the same logprobs and the
same per-token advantages as the same teacher loaded in process (within 1e-4), top-k included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.testing import build_tiny_model
from tokenmill.training.teacher import build_teacher, distill_groups, loss_teacher
from tokenmill.types import Group, Sample, StopReason


@pytest.fixture(scope="module")
def served_teacher(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("served") / "teacher", hidden_size=32, num_layers=1, seed=7)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", path, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield path, url
    finally:
        proc.kill()
        proc.wait(10)


def _groups(tokenizer) -> list[Group]:
    out = []
    for g, (prompt, answers) in enumerate((("12+3=", ("15", "1x6")), ("7+40=", ("47", "4a")))):
        p = tokenizer.encode(prompt)
        samples = tuple(
            Sample(tokens=tuple(p + tokenizer.encode(a)), loss_mask=(0,) * len(p) + (1,) * len(a),
                   logprobs=(0.0,) * len(p) + (-1.0,) * len(a), prompt_len=len(p), prompt=prompt, completion=a,
                   stop_reason=StopReason.STOP, group_id=g, reward=float(k == 0))
            for k, a in enumerate(answers))
        out.append(Group(g, samples))
    return out


@pytest.mark.parametrize("top_k", [0, 3])
def test_server_teacher_equals_in_process_teacher(served_teacher, tiny_model, tokenizer, top_k):
    path, url = served_teacher
    got = {}
    for name, teacher_cfg in (("local", {"path": path}), ("server", {"url": url})):
        dist = DistillConfig(teacher=teacher_cfg, top_k=top_k, task_weight=0.5)
        teacher = build_teacher(dist, tiny_model, tokenizer, torch.device("cpu"))
        try:
            scored = teacher.score([s for g in _groups(tokenizer) for s in g.samples])
            _, samples, metrics = distill_groups(_groups(tokenizer), teacher, dist, student=tiny_model,
                                                 pad_id=tokenizer.pad_token_id)
        finally:
            teacher.close()
        got[name] = (scored, samples, metrics)
    (local, local_samples, local_metrics), (remote, remote_samples, remote_metrics) = got["local"], got["server"]
    for a, b in zip(local, remote, strict=True):
        assert len(a.token_logprobs) == len(b.token_logprobs) > 0
        assert b.token_logprobs == pytest.approx(a.token_logprobs, abs=1e-4)
        if top_k:
            for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert set(x) == set(y) and [y[k] for k in x] == pytest.approx(list(x.values()), abs=1e-4)
    for a, b in zip(local_samples, remote_samples, strict=True):
        assert b.token_advantages == pytest.approx(a.token_advantages, abs=1e-4)
    assert remote_metrics["distill/reverse_kl"] == pytest.approx(local_metrics["distill/reverse_kl"], abs=1e-4)


def test_full_loss_with_a_top_k_server_equals_the_in_process_teacher(served_teacher, tiny_model_path, tokenizer):
    """`loss: full` with `top_k`: the trainer asks the server for each micro-batch's top-k lists; its bucketed
    KL term and the gradient it gives equal those of the same teacher asked in process (1e-4)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.training import LocalBackend, collate

    path, url = served_teacher
    samples = [s for g in _groups(tokenizer) for s in g.samples]
    batch = collate(samples, [0.25] * len(samples), tokenizer.pad_token_id)
    got = {}
    for name, teacher_cfg in (("local", {"path": path}), ("server", {"url": url})):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        dist = DistillConfig(teacher=teacher_cfg, top_k=3, loss="full")
        teacher = build_teacher(dist, model, tokenizer, torch.device("cpu"))
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, distill_teacher=loss_teacher(teacher, dist))
        try:
            metrics = backend.forward_backward(batch, lambda lp, b: ((lp * 0).sum(), {}))
        finally:
            teacher.close()
        got[name] = metrics["distill/reverse_kl"], [p.grad.clone() for p in model.parameters()]
    (local_kl, local_grads), (remote_kl, remote_grads) = got["local"], got["server"]
    assert local_kl > 1e-3 and remote_kl == pytest.approx(local_kl, abs=1e-4), (local_kl, remote_kl)
    assert max(float(g.abs().max()) for g in local_grads) > 1e-3  # a gradient well above the tolerance
    for a, b in zip(local_grads, remote_grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-3)
