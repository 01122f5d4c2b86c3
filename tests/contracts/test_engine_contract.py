"""The `InferenceEngine` contract (engines/base.py), run against every engine that ships.

An engine returns `n` completions per prompt in prompt order; each completion's logprobs are aligned with its
tokens and equal a teacher-forced pass of the weights it holds under softmax(logits / temperature) (1e-4,
fp32); `update_weights` makes the new weights sample and records their version; `state_dict` holds what an
exact resume needs (the sampling RNG, or nothing when sampling happens on a server); `close` is idempotent.

Adding an engine is one entry in `ENGINES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
from contract_helpers import named_weights, perturbed, served

from tokenmill.engines.base import InferenceEngine
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams

PROMPTS = [[5, 6, 7], [12, 30, 41, 8, 9], [20]]
PARAMS = SamplingParams(max_tokens=6, n=3, temperature=0.8)


@contextmanager
def hf_engine(path: str, tmp_path) -> Iterator[InferenceEngine]:
    from tokenmill.engines.local.hf import HFEngine

    engine = HFEngine.from_pretrained(path, seed=0)
    yield engine
    engine.close()


@contextmanager
def continuous_engine(path: str, tmp_path) -> Iterator[InferenceEngine]:
    from tokenmill.engines.local.continuous import ContinuousEngine

    engine = ContinuousEngine.from_pretrained(path, max_batch=16, seed=0)
    yield engine
    engine.close()


@contextmanager
def remote_engine(path: str, tmp_path) -> Iterator[InferenceEngine]:
    """A RemoteEngine over a real loopback server; weights reach it as safetensors files."""
    from transformers import AutoTokenizer

    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.sync import FileSync

    with ExitStack() as stack:
        server = stack.enter_context(served(path))
        pad_id = AutoTokenizer.from_pretrained(path).pad_token_id
        engine = RemoteEngine([server.url], pad_id=pad_id, sync=FileSync([server.url], tmp_path / "push"))
        stack.callback(engine.close)
        yield engine


@dataclass(frozen=True)
class EngineSpec:
    make: Callable[..., object]
    owns_rng: bool  # samples in this process, so its RNG state is part of a checkpoint


ENGINES = {
    "hf": EngineSpec(hf_engine, owns_rng=True),
    "continuous": EngineSpec(continuous_engine, owns_rng=True),
    "remote": EngineSpec(remote_engine, owns_rng=False),
}


@pytest.fixture(params=sorted(ENGINES))
def spec(request) -> EngineSpec:
    return ENGINES[request.param]


@pytest.fixture
def engine(spec, tiny_model_path, tmp_path):
    with spec.make(tiny_model_path, tmp_path) as engine:
        yield engine


def assert_logprobs_are_teacher_forced(completions, model, temperature: float) -> None:
    assert len(completions) == len(PROMPTS)
    for prompt, group in zip(PROMPTS, completions, strict=True):
        assert len(group) == PARAMS.n
        for c in group:
            assert 1 <= len(c.token_ids) <= PARAMS.max_tokens
            assert len(c.logprobs) == len(c.token_ids)
            expected = teacher_logprobs(model, prompt, c.token_ids, temperature=temperature)
            assert list(c.logprobs) == pytest.approx(expected, abs=1e-4)


def test_is_an_inference_engine(engine):
    assert isinstance(engine, InferenceEngine)
    assert isinstance(engine.pad_id, int) and isinstance(engine.version, int)


def test_generate_returns_n_completions_with_teacher_forced_logprobs(engine, reference):
    assert_logprobs_are_teacher_forced(engine.generate(PROMPTS, PARAMS), reference, PARAMS.temperature)


def test_update_weights_samples_from_the_new_weights_and_records_the_version(engine, reference):
    new = perturbed(reference, seed=1)
    engine.update_weights(named_weights(new), version=3)
    assert engine.version == 3
    completions = engine.generate(PROMPTS, PARAMS)
    assert_logprobs_are_teacher_forced(completions, new, PARAMS.temperature)
    # and not the old ones: the perturbation moves these logprobs by far more than the tolerance
    c = completions[0][0]
    old = teacher_logprobs(reference, PROMPTS[0], c.token_ids, temperature=PARAMS.temperature)
    assert max(abs(a - b) for a, b in zip(c.logprobs, old, strict=True)) > 1e-3


def test_state_dict_resumes_the_sampling_stream(engine, spec):
    state = engine.state_dict()
    first = [[c.token_ids for c in g] for g in engine.generate(PROMPTS, PARAMS)]
    engine.load_state_dict(state)
    again = [[c.token_ids for c in g] for g in engine.generate(PROMPTS, PARAMS)]
    if spec.owns_rng:
        assert state and again == first
    else:  # the server samples with its own RNG: nothing of it lives here
        assert state == {}


def test_close_is_idempotent(engine):
    engine.close()
    engine.close()
