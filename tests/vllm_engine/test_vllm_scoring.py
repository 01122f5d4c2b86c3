"""The engines' `Scorer` (`RemoteEngine.score`, vLLM's `prompt_logprobs`) against a real vLLM server: the scores
equal a teacher-forced pass within 1e-4, top-k lists included, also while the server generates for other
requests. The session's server runs with LoRA on, where vLLM 0.32's CPU build, unpatched, dies on a scoring
request batched with others (tokenmill's worker extension fixes that: `engines/vllm/worker_ext.py`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tokenmill.engines.local.scoring import score_sequences
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.types import SamplingParams


def test_scores_equal_teacher_forcing_while_the_server_generates(vllm_server, hf_model):
    sequences = [[3 + (7 * i) % 90 for i in range(n)] for n in (9, 20, 31, 40)]
    engine = RemoteEngine([vllm_server.url], pad_id=0)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:  # other requests in the same batches as the scoring
            busy = pool.submit(engine.generate, [[10, 11, 12, 13]] * 16, SamplingParams(max_tokens=24, n=2))
            scored = engine.score(sequences, top_k=3)
            sampled = busy.result()
    finally:
        engine.close()
    assert httpx.get(vllm_server.url + "/health", timeout=10).status_code == 200  # the server survived
    assert sum(len(c.token_ids) for group in sampled for c in group) > 0
    reference = score_sequences(hf_model, sequences, top_k=3)
    worst = top_worst = 0.0
    for got, (want, _ranks), ids in zip(scored, reference, sequences, strict=True):
        assert len(got.token_logprobs) == len(ids) - 1  # the first token has no score (vLLM's shape: None)
        worst = max(worst, max(abs(a - b) for a, b in zip(got.token_logprobs, want.token_logprobs)))
        for g, w in zip(got.top_logprobs, want.top_logprobs, strict=True):
            assert list(g) == list(w)  # the same 3 alternatives, in the same order
            top_worst = max(top_worst, max(abs(g[k] - w[k]) for k in w))
    assert worst <= 1e-4, f"vLLM's prompt logprobs are {worst:.3g} from teacher forcing"
    assert top_worst <= 1e-4, f"vLLM's top-3 logprobs are {top_worst:.3g} from teacher forcing"
