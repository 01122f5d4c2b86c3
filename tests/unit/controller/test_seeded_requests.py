"""`engine.placement: process` sends each request with a seed made of `training.seed`, the policy version and
the request's index since the last push: what a server samples does not depend on what it served before, so a
run resumed from a checkpoint draws what an uninterrupted run drew."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    from tokenmill.controller.placement import spawn_servers

    urls, procs = spawn_servers(tiny_model_path, 1, threads=1, timeout_s=120,
                                log_dir=tmp_path_factory.mktemp("server"))
    yield urls[0]
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _tokens(groups) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in group] for group in groups]


def test_the_same_request_index_and_version_draw_the_same_tokens(server):
    from tokenmill.controller.placement import seeded_remote_engine
    from tokenmill.types import SamplingParams

    params = SamplingParams(max_tokens=8, n=3, temperature=1.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    first = seeded_remote_engine([server], 7, pad_id=0, timeout_s=60)
    a = _tokens(first.generate(prompts, params))
    later = _tokens(first.generate(prompts, params))  # the next requests: other seeds
    assert later != a
    # a fresh client (a resumed run) at the same version: the same draws, whatever the server served before
    again = seeded_remote_engine([server], 7, pad_id=0, timeout_s=60)
    assert _tokens(again.generate(prompts, params)) == a
    assert _tokens(again.generate(prompts, params)) == later
    other = seeded_remote_engine([server], 8, pad_id=0, timeout_s=60)  # another training.seed
    assert _tokens(other.generate(prompts, params)) != a
    for engine in (first, again, other):
        engine.close()
