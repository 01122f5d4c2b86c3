"""Judges for tests of LLM-as-judge rewards. `train_echo_judge`: a tiny chat model trained, in seconds on a CPU,
to reply to a user message with the message's last character alone, so its greedy verdict is known in advance
(a message ending in "7" gets the reply "7", one ending in "A" the reply "A"). `ScriptedJudge`: a loopback
OpenAI chat endpoint whose answers, errors and delays a test sets.

    >>> path = train_echo_judge("/tmp/echo-judge")        # doctest: +SKIP  (~10 s)
    >>> server = ScriptedJudge(statuses=[503])            # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.serving import start_in_thread

ALPHABET = "0123456789ABxyzabc .?:\n"
LAST = "0123456789AB"  # the characters a message may end with (the verdicts)


def _example(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 60))) + rng.choice(LAST)


def train_echo_judge(path: str | Path, *, steps: int = 300, seed: int = 0) -> str:
    """Build a 1-layer, 64-wide chat model at `path` and train it (AdamW, 32 messages a step) to answer a user
    message with its last character then end of turn; return the path. Greedy replies are exact on messages of
    ALPHABET characters up to ~60 long that end in one of LAST."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.recipes.tiny import build_tiny_model

    path = build_tiny_model(path, hidden_size=64, num_layers=1, seed=seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(32):
            text = _example(rng)
            prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            a = tok(text[-1] + tok.eos_token, add_special_tokens=False)["input_ids"]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        target = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=target).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path)
    return str(path)


class ScriptedJudge:
    """A loopback OpenAI chat endpoint (`url`, a `/v1` base) for judge tests: `reply(content)` gives the answer
    to a request whose last message is `content`; the codes in `statuses` are answered first, one per request,
    as OpenAI-shaped errors; each answer waits `delay_s`. It counts the requests, keeps what they asked
    (`contents`) and the most in flight at once; `close()` stops it."""

    def __init__(self, reply=lambda content: "<score>5</score>", statuses=(), delay_s: float = 0.0) -> None:
        self.reply, self.statuses, self.delay_s = reply, list(statuses), delay_s
        self.requests, self.in_flight, self.most_in_flight = 0, 0, 0
        self.contents: list[str] = []
        self._lock = threading.Lock()
        app = FastAPI()
        app.post("/v1/chat/completions")(self._chat)
        self.server, _ = start_in_thread(app)
        self.url = self.server.url + "/v1"

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            status = self.statuses.pop(0) if self.statuses else 200
        try:
            await asyncio.sleep(self.delay_s)
            if status != 200:
                return JSONResponse({"error": {"message": f"scripted {status}", "type": "server_error"}}, status)
            content = body["messages"][-1]["content"]
            self.contents.append(content)
            return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                     "role": "assistant", "content": self.reply(content)}}]})
        finally:
            with self._lock:
                self.in_flight -= 1

    def close(self) -> None:
        self.server.stop()
