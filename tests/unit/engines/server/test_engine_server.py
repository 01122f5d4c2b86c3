"""The OpenAI-compatible engine server on a real loopback uvicorn: shapes, values, auth, bad bodies."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app, render_chat
from tokenmill.serving import start_in_thread
from tokenmill.testing.reference import teacher_logprobs

TOKEN = "s3cret-token"


@torch.no_grad()
def greedy_alone(model, prompt, steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(tiny_model_path):
    """(base url, engine) of an open server (no token)."""
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=64)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    yield server.url, engine
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served[0], timeout=60) as c:
        yield c


def test_health_and_models(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["policy_version"] == 0
    assert client.get("/v1/models").json() == {
        "object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "tokenmill"}]}


def test_completions_return_token_ids_and_teacher_forced_logprobs(client, reference, tokenizer):
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "n": 3,
                                                   "temperature": 0.7, "logprobs": 1}).json()
    assert answer["object"] == "text_completion" and answer["model"] == "tiny" and answer["policy_version"] == 0
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])
    for choice in answer["choices"]:
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert choice["prompt_token_ids"] == prompt and choice["policy_version"] == 0
        assert choice["finish_reason"] in ("stop", "length") and 1 <= len(ids) <= 6
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert logprobs == pytest.approx(teacher_logprobs(reference, prompt, ids, 0.7), abs=1e-4)


def test_several_prompts_text_and_ids_greedy_and_seeded(client, reference, tokenizer):
    ids = tokenizer("7+5=", add_special_tokens=False)["input_ids"]
    answer = client.post("/v1/completions", json={"prompt": ["The sum", "of 3"], "max_tokens": 5, "n": 2,
                                                   "temperature": 0}).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice, text in zip(answer["choices"], ["The sum", "The sum", "of 3", "of 3"], strict=True):
        prompt = tokenizer(text)["input_ids"]
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == greedy_alone(reference, prompt, 5)
    assert answer["choices"][0]["logprobs"] is None  # not asked for
    seeded = [client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 8, "seed": s}).json()
              for s in (11, 11, 12)]
    assert seeded[0]["choices"][0]["token_ids"] == seeded[1]["choices"][0]["token_ids"]
    assert seeded[0]["choices"][0]["token_ids"] != seeded[2]["choices"][0]["token_ids"]


def test_concurrent_http_requests_get_the_tokens_they_would_get_alone(client, reference, tokenizer):
    prompts = [tokenizer("x" * (2 + 5 * i) + "=", add_special_tokens=False)["input_ids"] for i in range(8)]

    def ask(i: int) -> list[int]:
        body = {"prompt": prompts[i], "max_tokens": 4 + 3 * i, "temperature": 0}
        return client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == [greedy_alone(reference, p, 4 + 3 * i) for i, p in enumerate(prompts)]


def test_chat_completions_render_the_template_and_return_logprobs(client, reference, tokenizer):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": [{"type": "text", "text": "2+2"}]}]
    answer = client.post("/v1/chat/completions", json={"model": "x", "messages": messages, "max_tokens": 5,
                                                        "logprobs": True, "temperature": 0}).json()
    expected_prompt = tokenizer("<|system|>Add.<|end|><|user|>2+2<|end|><|assistant|>",
                                add_special_tokens=False)["input_ids"]
    assert render_chat(tokenizer, messages) == expected_prompt
    [choice] = answer["choices"]
    assert answer["object"] == "chat.completion" and choice["prompt_token_ids"] == expected_prompt
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(choice["token_ids"],
                                                                                  skip_special_tokens=True)}
    assert choice["token_ids"] == greedy_alone(reference, expected_prompt, 5)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in choice["token_ids"]]
    expected = teacher_logprobs(reference, expected_prompt, choice["token_ids"])
    assert [c["logprob"] for c in content] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": [5, 100_000]}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 65}, "n"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
])
def test_bad_bodies_are_400_with_the_field_named(client, route, body, param):
    answer = client.post(route, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"]


def test_not_json_is_400(client):
    answer = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "error" in answer.json()


def test_token_host_and_origin_checks(tiny_model_path):
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=8)
    server, _ = start_in_thread(create_app(engine, model_name="tiny", token=TOKEN))
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/health").status_code == 200  # probes need no token
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                answer = c.post("/v1/completions", json=body, headers=headers)
                assert answer.status_code == 401
                assert answer.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models").status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            ok = c.post("/v1/completions", json=body, headers=auth)
            assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
            rebinding = c.post("/v1/completions", json=body, headers=auth | {"Host": "evil.example:8000"})
            assert rebinding.status_code == 400 and rebinding.json()["error"]["param"] == "Host"
            foreign = c.post("/v1/completions", json=body, headers=auth | {"Origin": "https://evil.example"})
            assert foreign.status_code == 403
            # the Origin is compared by scheme, host and port: another port on localhost is another origin
            other_port = c.post("/v1/completions", json=body, headers=auth | {"Origin": "http://127.0.0.1:3000"})
            assert other_port.status_code == 403 and other_port.json()["error"]["param"] == "Origin"
            same = c.post("/v1/completions", json=body, headers=auth | {"Origin": server.url})
            assert same.status_code == 200
    finally:
        server.stop()
        engine.close()


def served_with_new_weights(model_path, reference, folder):
    """(the reference times 1.25, saved to `folder`; a fresh engine of `model_path`; its server on loopback)."""
    new_model = copy.deepcopy(reference)
    with torch.no_grad():
        for p in new_model.parameters():
            p.mul_(1.25)
    new_model.save_pretrained(folder)
    engine = ContinuousEngine.from_pretrained(model_path, max_batch=8)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    return new_model, engine, server


def test_weight_update_from_disk_bumps_the_version_and_changes_the_logprobs(tiny_model_path, reference, tmp_path):
    new_model, engine, server = served_with_new_weights(tiny_model_path, reference, tmp_path / "v3")
    prompt = [10, 11, 12, 13]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            done = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "v3"),
                                                             "policy_version": 3}).json()
            assert done["success"] and done["policy_version"] == 3
            assert c.get("/health").json()["policy_version"] == 3
            answer = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 0}).json()
    finally:
        server.stop()
        engine.close()
    [choice] = answer["choices"]
    assert answer["policy_version"] == choice["policy_version"] == 3
    expected = teacher_logprobs(new_model, prompt, choice["token_ids"])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_weight_update_is_answered_while_a_request_is_still_running(tiny_model_path, reference, tmp_path):
    """The route stages the update: a push does not wait for the request in flight, which ends on the old
    weights; the next request runs on the new ones."""
    new_model, engine, server = served_with_new_weights(tiny_model_path, reference, tmp_path / "v4")
    prompt = [10, 11, 12, 13]
    long = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "logprobs": 0}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c, ThreadPoolExecutor(1) as pool:
            running = pool.submit(c.post, "/v1/completions", json=long)
            deadline = time.monotonic() + 30
            while engine.stats()["running_rows"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            done = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "v4"),
                                                             "policy_version": 4}).json()
            answered_first = not running.done()
            assert done["success"] and done["policy_version"] == 4
            after = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 0}).json()
            old = running.result(60).json()
    finally:
        server.stop()
        engine.close()
    assert answered_first, "the push waited for the running request"
    [slow], [fresh] = old["choices"], after["choices"]
    assert slow["policy_version"] == 0 and len(slow["token_ids"]) == 400
    assert slow["logprobs"]["token_logprobs"] == pytest.approx(
        teacher_logprobs(reference, prompt, slow["token_ids"]), abs=1e-4)
    assert fresh["policy_version"] == 4
    assert fresh["logprobs"]["token_logprobs"] == pytest.approx(
        teacher_logprobs(new_model, prompt, fresh["token_ids"]), abs=1e-4)


@pytest.mark.parametrize(("args", "message"), [
    (["--host", "0.0.0.0"], "refusing to serve on non-loopback host '0.0.0.0'"),
    (["--host", "0.0.0.0", "--allow-remote"], "--allow-remote together with --token"),
    (["--token", ""], "--token: must not be empty"),
])
def test_serve_refuses_unsafe_exposure_in_one_line(tiny_model_path, capsys, args, message):
    from tokenmill.cli import main

    assert main(["serve", tiny_model_path, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_serve_refuses_a_folder_without_a_model(tmp_path, capsys):
    from tokenmill.cli import main

    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "MODEL_DIR" in err and "no config.json" in err and err.count("\n") == 1


def test_serve_command_prints_its_url_and_serves(tiny_model_path):
    import os
    import re
    import selectors
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TOKENMILL_SERVE_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", tiny_model_path, "--port", "0",
                             "--served-model-name", "tiny-cli", "--max-batch", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline, line = time.monotonic() + 120, ""
        while "ready on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, f"no ready line; last: {line!r}"
            if selector.select(timeout=1):
                line = proc.stdout.readline()
        url = re.search(r"(http://\S+)/v1", line).group(1)
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/v1/models").status_code == 401  # the token came from $TOKENMILL_SERVE_TOKEN
            answer = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3},
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert answer["model"] == "tiny-cli" and len(answer["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a graceful stop, the CLI's "interrupted" status
        assert proc.wait(timeout=30) in (0, 130)
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------ hostile input
@pytest.mark.parametrize(("route", "raw", "param"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", b'{"prompt": [5, 6], "seed": 1180591620717411303424}', "seed"),
    ("/v1/completions", b'{"prompt": [5, 6], "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", b'{"prompt": [5, 6], "top_k": 100000000000000000000}', "top_k"),
])
def test_lone_surrogates_and_huge_numbers_are_openai_shaped_400s(client, route, raw, param):
    """A lone surrogate (valid JSON, not valid Unicode) used to reach the tokenizer (a plain-text 500), and
    `seed: 2**70` torch's seeding (a 400 without `param`)."""
    answer = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] is None
    assert client.get("/health").status_code == 200


def _health_latencies(url: str, busy) -> list[float]:
    """/health round trips (seconds) measured while `busy()` runs on another thread."""
    import threading

    done = threading.Event()
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = busy()
        finally:
            done.set()

    thread = threading.Thread(target=run)
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as c:
        thread.start()
        while not done.is_set():
            start = time.monotonic()
            assert c.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
    thread.join()
    return latencies, out["result"]


def test_a_5mb_prompt_is_refused_before_tokenising_and_health_stays_fast(tiny_model_path):
    """5 MB of text cannot fit 512 positions whatever its tokens: refused without tokenising (which took
    ~12 s here, on the event loop, stalling /health)."""
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=8)
    server, _ = start_in_thread(create_app(engine, model_name="tiny", max_body_bytes=8 * 2**20))
    prompt = "12+34=" * (5 * 2**20 // 6)
    try:
        def huge():
            with httpx.Client(base_url=server.url, timeout=60) as c:
                return [c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}),
                        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})]

        latencies, answers = _health_latencies(server.url, huge)
        for answer, param in zip(answers, ("prompt", "messages"), strict=True):
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param
            assert "over the model's context of 512 positions" in answer.json()["error"]["message"]
        assert max(latencies) < 0.5, max(latencies)
        with httpx.Client(base_url=server.url, timeout=60) as c:  # the default cap: 4 MiB
            assert c.post("/v1/completions", json={"prompt": prompt * 2}).status_code == 413
    finally:
        server.stop()
        engine.close()


def test_tokenising_runs_off_the_event_loop(tiny_model_path, tokenizer):
    """A model with a long context must tokenise a 1 MB prompt: in a worker thread, /health answers meanwhile."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.config.max_position_embeddings = 100_000  # 1M characters may be fewer tokens: they are counted
    engine = ContinuousEngine(model, tokenizer, max_batch=8)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    prompt = "1" * 2**20
    try:
        def huge():
            with httpx.Client(base_url=server.url, timeout=120) as c:
                start = time.monotonic()
                answer = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                return answer, time.monotonic() - start

        latencies, (answer, took) = _health_latencies(server.url, huge)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
        assert "1048576 tokens leave no room" in answer.json()["error"]["message"]
        assert took > 0.3 and len(latencies) >= 5, (took, len(latencies))  # tokenising took a while...
        assert max(latencies) < took / 2, (max(latencies), took)  # ...and /health did not wait for it
    finally:
        server.stop()
        engine.close()
