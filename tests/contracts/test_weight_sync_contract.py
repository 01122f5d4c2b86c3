"""The `WeightSync` contract (sync/base.py), run against every way weights travel.

After `push(named_tensors, version)` returns, the engine samples from those tensors (its logprobs equal a
teacher-forced pass of the pushed weights within 1e-4) and reports `version`; a push the engine cannot take
(a tensor of the wrong shape) raises `WeightSyncError` naming the tensor, and the engine keeps the weights and
version it had; `close` is idempotent.

Adding a way is one entry in `SYNCS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
import torch
from contract_helpers import named_weights, perturbed, served

from tokenmill.sync import WeightSync, WeightSyncError
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams

PROMPT = [5, 9, 14, 3, 22, 7]
PARAMS = SamplingParams(max_tokens=6, n=2, temperature=1.0)


@dataclass
class Rig:
    sync: WeightSync
    engine: object  # the engine the sync feeds (in this process, so the test can sample from it)


@contextmanager
def inprocess(path: str, tmp_path) -> Iterator[Rig]:
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.sync import InProcessSync

    engine = HFEngine.from_pretrained(path, seed=0)
    yield Rig(InProcessSync(engine), engine)
    engine.close()


@contextmanager
def files(path: str, tmp_path) -> Iterator[Rig]:
    from tokenmill.sync import FileSync

    with served(path) as server:
        yield Rig(FileSync([server.url], tmp_path / "push"), server.engine)


@contextmanager
def broadcast(path: str, tmp_path) -> Iterator[Rig]:
    from tokenmill.sync import BroadcastSync

    with ExitStack() as stack:
        server = stack.enter_context(served(path))
        yield Rig(BroadcastSync([server.url], backend="gloo"), server.engine)


SYNCS: dict[str, Callable[..., object]] = {"inprocess": inprocess, "files": files, "broadcast": broadcast}


@pytest.fixture(params=sorted(SYNCS))
def rig(request, tiny_model_path, tmp_path):
    with SYNCS[request.param](tiny_model_path, tmp_path) as rig:
        yield rig
        rig.sync.close()


def assert_samples_from(engine, model) -> None:
    [group] = engine.generate([PROMPT], PARAMS)
    for c in group:
        assert list(c.logprobs) == pytest.approx(teacher_logprobs(model, PROMPT, c.token_ids), abs=1e-4)


def test_is_a_weight_sync(rig):
    assert isinstance(rig.sync, WeightSync)


def test_push_lands_with_its_version(rig, reference):
    for version, seed in ((1, 11), (2, 12)):
        new = perturbed(reference, seed=seed)
        rig.sync.push(named_weights(new), version=version)
        assert rig.engine.version == version
        assert_samples_from(rig.engine, new)


def test_a_refused_push_names_the_tensor_and_keeps_the_old_weights(rig, reference):
    first = perturbed(reference, seed=21)
    rig.sync.push(named_weights(first), version=1)
    bad = [(n, torch.zeros(3, 3) if n == "model.norm.weight" else t) for n, t in named_weights(reference)]
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        rig.sync.push(bad, version=2)
    assert rig.engine.version == 1
    assert_samples_from(rig.engine, first)


def test_close_is_idempotent(rig):
    rig.sync.close()
    rig.sync.close()
