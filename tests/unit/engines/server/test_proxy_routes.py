"""Proxy mode over a real loopback server: the OpenAI SDK plays two turns, the recording is exact token truth."""

from __future__ import annotations

import httpx
import pytest

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app
from tokenmill.engines.server.recorder import EpisodeRecorder
from tokenmill.serving import start_in_thread
from tokenmill.testing.reference import teacher_logprobs

openai = pytest.importorskip("openai")


@pytest.fixture
def proxy(tiny_model, tokenizer):
    recorder = EpisodeRecorder()
    engine = ContinuousEngine(tiny_model, tokenizer, seed=0)
    app = create_app(engine, model_name="policy", recorder=recorder, default_max_tokens=6, max_tokens_cap=6)
    server, _ = start_in_thread(app)
    yield server.url, recorder
    server.stop()
    engine.close()


def test_an_sdk_agent_episode_is_recorded_as_one_exact_sample(proxy, tiny_model, tokenizer):
    url, recorder = proxy
    client = openai.OpenAI(base_url=f"{url}/proxy/ep-1/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "guess"}, {"role": "user", "content": "1-7"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "hi"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, temperature=1.0)
    done = httpx.post(f"{url}/v1/episodes/ep-1/reward", json={"reward": 0.5, "group": "g"}).json()
    assert done == {"episode_id": "ep-1", "calls": 2, "reward": 0.5, "group": "g"}

    [episode] = recorder.take_finished(10)
    samples = episode.samples(group_id=0)
    replies = [first.choices[0].model_extra["token_ids"], second.choices[0].model_extra["token_ids"]]
    prompt2 = second.choices[0].model_extra["prompt_token_ids"]
    if len(samples) == 1:  # the template re-renders the first reply exactly as sampled: one merged sample
        [s] = samples
        assert list(s.tokens) == prompt2 + replies[1]
        assert sum(s.loss_mask) == len(replies[0]) + len(replies[1])
    else:  # the reply stopped at the end token, which the template renders differently: two segments
        assert [list(s.tokens[s.prompt_len:]) for s in samples] == replies
    for s in samples:
        trained = [i for i, m in enumerate(s.loss_mask) if m]
        want = teacher_logprobs(tiny_model, s.tokens[: s.prompt_len], s.tokens[s.prompt_len :])
        got = [s.logprobs[i] for i in range(s.prompt_len, len(s.tokens))]
        for i in trained:
            assert abs(got[i - s.prompt_len] - want[i - s.prompt_len]) < 1e-4
        assert all(s.logprobs[i] == 0.0 for i in range(len(s.tokens)) if not s.loss_mask[i])
    assert samples[0].reward == 0.5 and first.model_extra["policy_version"] == 0


def test_bad_requests_are_refused_naming_the_field(proxy):
    url, _ = proxy
    chat = {"model": "policy", "messages": [{"role": "user", "content": "1-7"}]}

    def error(r):
        return r.json()["error"]

    r = httpx.post(f"{url}/proxy/e/v1/chat/completions", json=chat | {"n": 2})
    assert r.status_code == 400 and error(r)["param"] == "n"
    r = httpx.post(f"{url}/proxy/bad id!/v1/completions", json={"prompt": "1+1="})
    assert r.status_code == 400 and "episode_id" in error(r)["message"]
    r = httpx.post(f"{url}/v1/episodes/never/reward", json={"reward": 1.0})
    assert r.status_code == 404 and "'never' is not open" in error(r)["message"]
    r = httpx.post(f"{url}/proxy/t/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    r = httpx.post(f"{url}/v1/episodes/t/reward", json={"reward": "lots"})
    assert r.status_code == 400 and error(r)["param"] == "reward"
    assert httpx.get(f"{url}/v1/episodes").json() == {"open": 1, "finished": 0, "dropped": 0}
