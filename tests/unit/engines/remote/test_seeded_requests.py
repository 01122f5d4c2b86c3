"""`RemoteEngine(seed=...)`, what `engine.placement: process` uses: each request carries a seed made of
`training.seed`, the policy version and the index of its first prompt since the last push, so what a server
samples does not depend on what it served before and a run resumed from a checkpoint draws what an
uninterrupted run drew."""

from __future__ import annotations

import pytest

from tokenmill.engines.base import call_seed
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.types import SamplingParams


class _Accepting:
    """A `WeightSync` that takes every push (nothing is sent)."""

    def push(self, named_tensors, version: int) -> None:
        pass


def _answering(engine: RemoteEngine, sent: list[dict]) -> None:
    """Record the completion bodies `engine` sends, answering each with one one-token choice per prompt and
    sample (the client's side alone: what goes on the wire)."""

    def post(path: str, body: dict) -> dict:
        sent.append(body)
        prompts = 1 if isinstance(body["prompt"][0], int) else len(body["prompt"])
        choice = {"token_ids": [3], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
        return {"choices": [dict(choice, index=i) for i in range(prompts * body["n"])], "policy_version": 0}

    engine.pool.post = post


def _seeds(sent: list[dict]) -> dict[tuple[int, ...], int]:
    """Each request's first tokens of its prompts -> its seed (requests go out concurrently, in any order)."""
    return {(tuple(b["prompt"][:1]) if isinstance(b["prompt"][0], int) else tuple(p[0] for p in b["prompt"])):
            b["seed"] for b in sent}


def test_each_request_carries_the_seed_of_the_version_and_its_first_prompt():
    engine = RemoteEngine(["http://127.0.0.1:9", "http://127.0.0.1:10"], pad_id=0, prompts_per_request=0, seed=7,
                          sync=_Accepting())
    sent: list[dict] = []
    _answering(engine, sent)
    params = SamplingParams(max_tokens=1, n=2)
    engine.generate([[5], [6], [7]], params)  # two servers: requests of prompts 0-1 and 2
    engine.generate([[8], [9]], params)  # the next call's prompts are 3 and 4 since the push
    assert _seeds(sent) == {(5, 6): call_seed(7, 0, 0), (7,): call_seed(7, 0, 2), (8,): call_seed(7, 0, 3),
                            (9,): call_seed(7, 0, 4)}
    assert len(set(_seeds(sent).values())) == 4
    engine.update_weights([], version=5)  # a push starts the count again, at the new version
    sent.clear()
    engine.generate([[5], [6], [7]], params)
    assert _seeds(sent) == {(5, 6): call_seed(7, 5, 0), (7,): call_seed(7, 5, 2)}
    engine.close()


def test_an_unseeded_engine_sends_no_seed():
    engine = RemoteEngine(["http://127.0.0.1:9"], pad_id=0)
    sent: list[dict] = []
    _answering(engine, sent)
    engine.generate([[5], [6]], SamplingParams(max_tokens=1))
    assert len(sent) == 2 and all("seed" not in b for b in sent)
    engine.close()


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    from tokenmill.engines.server.app import spawn_servers

    urls, procs = spawn_servers(tiny_model_path, 1, threads=1, timeout_s=120,
                                log_dir=tmp_path_factory.mktemp("server"))
    yield urls[0]
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _tokens(groups) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in group] for group in groups]


def test_the_same_request_index_and_version_draw_the_same_tokens(server):
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    first = RemoteEngine([server], pad_id=0, timeout_s=60, prompts_per_request=0, seed=7)
    a = _tokens(first.generate(prompts, params))
    later = _tokens(first.generate(prompts, params))  # the next requests: other seeds
    assert later != a
    # a fresh client (a resumed run) at the same version: the same draws, whatever the server served before
    again = RemoteEngine([server], pad_id=0, timeout_s=60, prompts_per_request=0, seed=7)
    assert _tokens(again.generate(prompts, params)) == a
    assert _tokens(again.generate(prompts, params)) == later
    other = RemoteEngine([server], pad_id=0, timeout_s=60, prompts_per_request=0, seed=8)  # another training.seed
    assert _tokens(other.generate(prompts, params)) != a
    for engine in (first, again, other):
        engine.close()
