"""`stream: true` and client disconnects on a real loopback engine server, read with the real OpenAI SDK."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app
from tokenmill.engines.server.recorder import EpisodeRecorder
from tokenmill.serving import start_in_thread

openai = pytest.importorskip("openai")


LONG = 50_000  # tokens a cancelled request would generate (minutes here): it must stop long before


@pytest.fixture(scope="module")
def served(tiny_model_path, tokenizer):
    """(url, engine, recorder) of an open server in proxy mode (so /v1 and /proxy/<episode>/v1 both exist),
    over a model whose context is long enough for a request that would run for minutes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.config.max_position_embeddings = 2 * LONG
    engine = ContinuousEngine(model, tokenizer, max_batch=16)
    recorder = EpisodeRecorder()
    server, _ = start_in_thread(create_app(engine, model_name="tiny", recorder=recorder))
    yield server.url, engine, recorder
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def sdk(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def _streamed_chat(chunks) -> tuple[str, list[int], list[float], str]:
    text, ids, logprobs, finish = "", [], [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        [choice] = chunk.choices
        text += choice.delta.content or ""
        ids += choice.model_extra["token_ids"]
        logprobs += [c.logprob for c in (choice.logprobs.content if choice.logprobs else None) or []]
        finish = choice.finish_reason or finish
    return text, ids, logprobs, finish


def test_streamed_chat_equals_the_plain_answer_for_the_same_seed(sdk):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2"}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 24, "seed": 5, "logprobs": True}
    plain = sdk.chat.completions.create(**kwargs).choices[0]
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text, ids, logprobs, finish = _streamed_chat(chunks)
    assert text == plain.message.content and text
    assert ids == plain.model_extra["token_ids"] and len(ids) == chunks[-1].usage.completion_tokens
    assert logprobs == [c.logprob for c in plain.logprobs.content]
    assert finish == plain.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-2].choices[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]


def test_streamed_completions_hold_back_what_a_stop_string_may_cut(sdk):
    for stop in (None, ["9"], ["ab", "+="]):
        kwargs = {"model": "tiny", "prompt": ["12+34=", "7*"], "max_tokens": 30, "seed": 3, "n": 2, "stop": stop,
                  "logprobs": 1}
        plain = sdk.completions.create(**kwargs)
        texts, ids, lps = [""] * 4, [[] for _ in range(4)], [[] for _ in range(4)]
        finish = [None] * 4
        for chunk in sdk.completions.create(**kwargs, stream=True):
            [choice] = chunk.choices
            texts[choice.index] += choice.text
            ids[choice.index] += choice.model_extra["token_ids"]
            lps[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
            finish[choice.index] = choice.finish_reason or finish[choice.index]
        assert texts == [c.text for c in plain.choices], stop
        assert ids == [c.model_extra["token_ids"] for c in plain.choices]
        assert lps == [c.logprobs.token_logprobs for c in plain.choices]
        assert finish == [c.finish_reason for c in plain.choices]


def test_the_stream_is_server_sent_events_ending_in_done(served):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": True}
    r = httpx.post(f"{served[0]}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert len(events) - 2 == 3 + 1  # one chunk per token (max_tokens 3, a length stop), then the finish chunk


def test_streaming_through_the_proxy_records_the_episode(served, tokenizer):
    url, _, recorder = served
    agent = openai.OpenAI(base_url=f"{url}/proxy/ep-s/v1", api_key="none", max_retries=0)
    chunks = list(agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1-7"}],
                                                max_tokens=5, seed=1, stream=True))
    text, ids, _, _ = _streamed_chat(chunks)
    done = httpx.post(f"{url}/v1/episodes/ep-s/reward", json={"reward": 1.0}).json()
    assert done["calls"] == 1
    [episode] = recorder.take_finished(10)
    [sample] = episode.samples(group_id=0)
    assert list(sample.tokens[sample.prompt_len:]) == ids and sample.reward == 1.0
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def _wait_idle(engine, timeout_s: float = 2.0) -> float:
    start = time.monotonic()
    while engine.stats()["running_rows"] or engine.stats()["waiting_requests"]:
        assert time.monotonic() - start < timeout_s, engine.stats()
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_client_that_goes_away_cancels_its_streamed_request(served):
    url, engine, _ = served
    before = engine.generated_tokens
    body = {"prompt": "1", "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {") and next(lines) == ""
        assert next(lines).startswith("data: {")  # a second token: its row is in the running batch
        assert engine.stats()["running_rows"] == 1
    # the connection is closed: decoding stops at the engine's next step
    assert _wait_idle(engine) < 1.0
    generated = engine.generated_tokens - before
    time.sleep(0.2)
    assert engine.generated_tokens - before == generated < LONG // 10


def test_a_client_that_goes_away_cancels_its_plain_request(served):
    url, engine, _ = served
    before = engine.generated_tokens
    body = {"prompt": "1", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert _wait_idle(engine) < 1.0
    assert engine.generated_tokens - before < LONG // 10


def test_a_streamed_tool_call_arrives_whole_in_the_finish_chunk(tokenizer):
    """With `tools`, text may turn out to be a tool call: token chunks carry ids only, the finish chunk the call."""
    import json

    from tokenmill.engines.server.streaming import Streamer, StreamSpec
    from tokenmill.types import Completion, StopReason

    text = 'ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spec = StreamSpec(chat=True, model_name="tiny", prompts=[[5]], n=1, logprobs=False, tools=True, stops=(),
                      include_usage=False)
    streamer = Streamer(tokenizer, spec)
    chunks = [json.loads(streamer.token(0, t, -0.5)[6:]) for t in ids]
    assert all("content" not in c["choices"][0]["delta"] for c in chunks)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in ids]
    done = Completion(tuple(ids), (-0.5,) * len(ids), StopReason.STOP, text)
    [last] = json.loads(streamer.finish(0, done, [5], 3)[6:])["choices"]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == "ok"
    [call] = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert last["prompt_token_ids"] == [5] and last["policy_version"] == 3


@pytest.mark.parametrize("incremental", [True, False])
def test_streamed_text_is_the_decoded_reply_cut_at_the_stop(tokenizer, incremental):
    """Both ways of decoding a stream (tokenizers' DecodeStream, or the whole reply at each token) send exactly
    the text the plain answer has: the reply decoded without special tokens, cut before the first stop string."""
    import copy
    import json

    from tokenmill.engines.server.streaming import Streamer, StreamSpec
    from tokenmill.types import Completion, StopReason

    tok = copy.deepcopy(tokenizer)
    tok.clean_up_tokenization_spaces = not incremental  # a tokenizer that rewrites spaces is decoded whole
    reply = "<|user|>12+34= 46<|end|> and 7*8=56; done"
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    for stops in ((), ("=5",), ("; d", "8=")):
        spec = StreamSpec(chat=False, model_name="t", prompts=[[5]], n=1, logprobs=False, tools=False, stops=stops,
                          include_usage=False)
        streamer = Streamer(tok, spec)
        assert (streamer.choices[0].decoder is not None) is incremental
        chunks = [json.loads(streamer.token(0, t, 0.0)[6:]) for t in ids]
        full = tok.decode(ids, skip_special_tokens=True)
        cut = min([len(full)] + [full.find(s) for s in stops if s in full])
        last = json.loads(streamer.finish(0, Completion(tuple(ids), (0.0,) * len(ids), StopReason.STOP,
                                                        full[:cut]), [5], 0)[6:])
        assert "".join(c["choices"][0]["text"] for c in [*chunks, last]) == full[:cut], stops
