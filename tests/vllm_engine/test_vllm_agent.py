"""Multi-turn episodes sampled by a real vLLM server: the token ids an episode trains on are, turn by turn, exactly
the ids vLLM sampled (tokenmill applies the chat template and sends token ids; nothing is re-tokenised), and the
trained logprobs are the teacher-forced logprobs of the whole episode."""

from __future__ import annotations

from collections import Counter

from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.envs.guess import GuessNumberEnv
from tokenmill.rollout.agent import AgentLimits, AgentLoop
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams


def _spans(mask: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s: the sampled turns."""
    spans, start = [], None
    for i, m in enumerate((*mask, 0)):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_episode_tokens_are_vllms_sampled_ids(vllm_server, vllm_model, hf_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_model)
    engine = RemoteEngine([vllm_server.url], pad_id=tokenizer.pad_token_id)
    sent: Counter = Counter()  # (prompt ids, sampled ids) of every request vLLM answered
    post = engine.pool.post

    def recording_post(path, body):
        answer = post(path, body)
        for choice in answer["choices"]:
            sent[(tuple(body["prompt"]), tuple(choice["token_ids"]))] += 1
        return answer

    engine.pool.post = recording_post
    loop = AgentLoop(engine, tokenizer, lambda: GuessNumberEnv(max_turns=3), SamplingParams(max_tokens=6, n=1),
                     AgentLimits(max_turns=3, end_on_truncation=False))
    try:
        groups, _ = loop.rollout([{"prompt": "1-7", "secret": 4, "high": 7}] * 2, group_size=2)
    finally:
        engine.close()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4
    turns, worst = 0, 0.0
    for s in samples:
        messages = s.row["messages"]
        assert s.tokens[: s.prompt_len] == tuple(tokenizer.apply_chat_template(
            messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False))
        for start, end in _spans(s.loss_mask):
            key = (s.tokens[:start], s.tokens[start:end])
            assert sent[key] > 0, f"turn at {start}:{end} is not what vLLM sampled for that context"
            sent[key] -= 1
            turns += 1
        ref = teacher_logprobs(hf_model, s.tokens[:1], s.tokens[1:])
        worst = max(worst, max(abs(lp - ref[i - 1]) for i, (lp, m) in enumerate(zip(s.logprobs, s.loss_mask))
                               if m))
    assert sum(sent.values()) == 0  # every answer vLLM gave is in exactly one episode
    assert turns >= 6 and max(s.row["turns"] for s in samples) >= 2  # multi-turn: several turns per episode
    assert worst <= 1e-4, f"trained logprobs are {worst:.3g} from teacher forcing over the episode"
