"""The Scorer primitive: in-process, over `tokenmill serve` (vLLM's prompt_logprobs) and through RemoteEngine."""

from __future__ import annotations

import httpx
import pytest
import torch

from tokenmill.engines import HFEngine
from tokenmill.engines.base import Scorer
from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.engines.server.app import create_app
from tokenmill.serving import start_in_thread
from tokenmill.training.local import token_logprobs

SEQS = [[3, 17, 22, 9, 41, 5, 8], [12, 30], [7, 7, 7, 1, 2, 3, 4, 5, 6, 10, 11, 13]]  # lengths differ: padding


@torch.no_grad()
def forward_logprobs(model, ids: list[int]) -> list[float]:
    """The trainer's teacher-forced logprobs of one unpadded sequence (temperature 1)."""
    ids_1_T = torch.tensor([ids])
    return token_logprobs(model(ids_1_T).logits, ids_1_T, 1.0)[0, 1:].tolist()


@torch.no_grad()
def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_in_process_score_equals_a_teacher_forced_forward(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    assert isinstance(engine, Scorer)
    scored = engine.score(SEQS)
    for ids, s in zip(SEQS, scored, strict=True):
        assert len(s.token_logprobs) == len(ids) - 1 and s.top_logprobs is None
        assert s.token_logprobs == pytest.approx(forward_logprobs(tiny_model, ids), abs=1e-6)
    assert engine.score([[5]])[0].token_logprobs == ()  # one token: nothing to score


def test_top_k_holds_the_k_most_likely_tokens(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    [s] = engine.score([SEQS[0]], top_k=3)
    full = full_logprobs(tiny_model, SEQS[0])
    assert len(s.top_logprobs) == len(SEQS[0]) - 1
    for t, tops in enumerate(s.top_logprobs):
        values, ids = torch.topk(full[t], 3)
        assert list(tops) == ids.tolist()
        assert list(tops.values()) == pytest.approx(values.tolist(), abs=1e-6)
    [(_, ranks)] = engine.score_ranked([SEQS[0]])
    assert list(ranks) == [int((full[t] > full[t, tok]).sum()) + 1 for t, tok in enumerate(SEQS[0][1:])]


@pytest.mark.parametrize(("seqs", "top_k", "field"), [
    ([[1, 2]], -1, "top_k"), ([[]], 0, "sequences"), ([[1, 10**6]], 0, "sequences"), ([[1, -3]], 0, "sequences")])
def test_bad_score_requests_are_refused_naming_the_field(tiny_model, tokenizer, seqs, top_k, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        HFEngine(tiny_model, tokenizer).score(seqs, top_k=top_k)


@pytest.fixture(scope="module")
def served(tiny_model_path):
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=16)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    yield server.url, engine
    server.stop()
    engine.close()


def test_server_prompt_logprobs_in_vllms_shape_equal_in_process(served, tiny_model, tokenizer):
    url, _ = served
    ids = SEQS[0]
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 0, "prompt_logprobs": 2},
                        timeout=60).json()
    [choice] = answer["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and choice["token_ids"] == []
    full = full_logprobs(tiny_model, ids)
    for t, (tok, entry) in enumerate(zip(ids[1:], entries[1:], strict=True)):
        own = entry[str(tok)]
        assert own["logprob"] == pytest.approx(full[t, tok].item(), abs=1e-5)
        assert own["rank"] == int((full[t] > full[t, tok]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([tok])
        top2 = torch.topk(full[t], 2).indices.tolist()
        assert set(entry) == {str(tok), *map(str, top2)}
        assert [entry[str(i)]["rank"] for i in top2] == [1, 2]
    # with max_tokens 1 a token is sampled as well, and the scores are the same
    sampled = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0},
                         timeout=60).json()["choices"][0]
    assert len(sampled["token_ids"]) == 1
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], sampled["prompt_logprobs"][1:], strict=True)] == \
        pytest.approx([e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:], strict=True)], abs=1e-6)


def test_remote_engine_scores_equal_in_process(served, tiny_model, tokenizer):
    url, _ = served
    remote = RemoteEngine([url], pad_id=0)
    local = HFEngine(tiny_model, tokenizer).score(SEQS, top_k=3)
    try:
        assert isinstance(remote, Scorer)
        for r, x in zip(remote.score(SEQS, top_k=3), local, strict=True):
            assert r.token_logprobs == pytest.approx(x.token_logprobs, abs=1e-5)
            assert [list(d) for d in r.top_logprobs] == [list(d) for d in x.top_logprobs]
            assert [v for d in r.top_logprobs for v in d.values()] == \
                pytest.approx([v for d in x.top_logprobs for v in d.values()], abs=1e-5)
        [(each_url, scores)] = remote.score_each([SEQS[1]]).items()
        assert each_url == url and scores[0].token_logprobs == pytest.approx(local[1].token_logprobs, abs=1e-5)
    finally:
        remote.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": 5000}, "prompt_logprobs"),
    ({"prompt": [1, 10**6], "max_tokens": 0, "prompt_logprobs": 0}, "prompt"),
    ({"prompt": [], "max_tokens": 0, "prompt_logprobs": 0}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": 1, "n": 2}, "n"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_scoring_bodies_get_openai_shaped_400s(served, body, param):
    r = httpx.post(f"{served[0]}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
