"""Shared fixtures: one tiny real model (built locally, never downloaded) per test session."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A 1-layer, 32-wide random Llama with the character tokenizer, saved as an HF folder."""
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=1, seed=0)


@pytest.fixture
def tiny_model(tiny_model_path):
    """A fresh fp32 copy of the tiny model (tests may change its weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def echo_judge_path(tmp_path_factory) -> str:
    """A tiny chat model whose greedy reply is its user message's last character (a judge whose verdicts are
    known in advance; `tokenmill.testing.judge`)."""
    from tokenmill.testing.judge import train_echo_judge

    return train_echo_judge(tmp_path_factory.mktemp("echo-judge") / "model")


@pytest.fixture(scope="module")
def echo_judge(echo_judge_path):
    """The base URL (`.../v1`) of `tokenmill serve`'s app over a judge that replies with the last character."""
    from tokenmill.engines.local.continuous import ContinuousEngine
    from tokenmill.engines.server.app import create_app
    from tokenmill.serving import start_in_thread

    engine = ContinuousEngine.from_pretrained(echo_judge_path, max_batch=64)
    server, _ = start_in_thread(create_app(engine, model_name="echo"))
    yield server.url + "/v1"
    server.stop()
    engine.close()


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory) -> str:
    """A random 2-layer Qwen2.5-VL (vision tower, merger, multimodal positions) with the character tokenizer and
    a Qwen2-VL image processor, saved as an HF folder (`tokenmill.recipes.tiny_vlm`)."""
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model", hidden_size=32, seed=0)


@pytest.fixture(scope="session")
def qwen2_vl_path(tmp_path_factory) -> str:
    """`tiny_vlm_path`'s kit as a Qwen2-VL (its own vision tower and rotary positions)."""
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("qwen2-vl") / "model", hidden_size=32, family="qwen2_vl")


@pytest.fixture(scope="session")
def qwen3_vl_path(tmp_path_factory) -> str:
    """`tiny_vlm_path`'s kit as a Qwen3-VL (deepstack features, interleaved multimodal positions)."""
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("qwen3-vl") / "model", hidden_size=32, family="qwen3_vl")


@pytest.fixture
def restored_torch():
    """`make_deterministic` switches process-wide torch settings: put them back for the tests after this one."""
    algorithms, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(algorithms)
    torch.set_num_threads(threads)
