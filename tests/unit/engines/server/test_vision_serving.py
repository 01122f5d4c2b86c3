"""`tokenmill serve` over the tiny Qwen2.5-VL on a real loopback server: chat with `image_url` parts answers what
the in-process VisionEngine samples, and a bad image is a 400 naming its part."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from tokenmill.data.images import ImagePolicy
from tokenmill.engines.server.app import create_app
from tokenmill.serving import start_in_thread
from tokenmill.types import SamplingParams

pytest.importorskip("PIL")


def _picture(colour, size=32):
    from PIL import Image

    return Image.new("RGB", (size, size), colour)


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def served(tiny_vlm_path):
    from tokenmill.engines.server.vision_serving import VisionServingEngine

    engine = VisionServingEngine.from_pretrained(tiny_vlm_path, seed=0, policy=ImagePolicy(max_pixels=64 * 64))
    server, _ = start_in_thread(create_app(engine, model_name="tiny-vlm"))
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, engine
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def in_process(tiny_vlm_path):
    """An independent VisionEngine and processor over the same folder (the reference)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionEngine, VisionProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    processor = VisionProcessor.from_pretrained(tiny_vlm_path)
    return VisionEngine(model, processor.tokenizer, seed=0), processor


def test_chat_with_images_equals_in_process_engine(served, in_process, tmp_path):
    client, _ = served
    engine, processor = in_process
    red, green = _picture((255, 0, 0)), _picture((0, 200, 0), 48)
    green.save(tmp_path / "green.png")
    messages = [{"role": "user", "content": [_part(_data_url(red)), {"type": "text", "text": "how many?"},
                                             _part(str(tmp_path / "green.png"))]}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                        "logprobs": True, "n": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    slots = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}, {"type": "image"}]}]
    ids, inputs = processor.encode(slots, [red, green])
    assert ids.count(engine.model.config.image_token_id) == 4 + 9  # both pictures reached the prompt
    [want] = engine.generate([ids], SamplingParams(max_tokens=6, n=2, greedy=True), images=[inputs])
    assert body["usage"]["prompt_tokens"] == len(ids)
    for choice, c in zip(body["choices"], want, strict=True):
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == list(c.token_ids)
        assert choice["message"]["content"] == c.text
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert got == pytest.approx(list(c.logprobs), abs=1e-5)
        assert choice["finish_reason"] == c.stop_reason.value


def test_a_text_only_chat_and_seeded_sampling(served, in_process):
    client, _ = served
    engine, processor = in_process
    messages = [{"role": "user", "content": "hello"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 1.0, "seed": 7, "logprobs": True}
    first, second = (client.post("/v1/chat/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]  # the seed decides the draw
    ids, _ = processor.encode(messages, [])
    assert first["choices"][0]["prompt_token_ids"] == ids
    engine.generator = torch.Generator().manual_seed(7)
    [[c]] = engine.generate([ids], SamplingParams(max_tokens=5), images=[None])
    assert first["choices"][0]["token_ids"] == list(c.token_ids)


def test_streamed_chat_with_an_image_gives_the_same_tokens(served):
    client, _ = served
    messages = [{"role": "user", "content": [_part(_data_url(_picture((0, 0, 255)))), {"type": "text", "text": "?"}]}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    import json

    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines if json.loads(line[6:])["choices"])
    assert text == plain


@pytest.mark.parametrize(("url", "reason"), [
    ("data:image/png;base64," + base64.b64encode(b"not a picture at all").decode(), "cannot identify image"),
    ("data:image/png;base64,@@@", "base64"),
    ("/nowhere/gone.png", "no such file"),
    ("https://example.com/cat.png", "--allow-remote-images"),
    ("oversized", "the server's --max-image-pixels (4096)"),
])
def test_a_bad_image_is_a_400_naming_its_part(served, url, reason):
    client, _ = served
    if url == "oversized":
        url = _data_url(_picture((9, 9, 9), 100))  # 100 x 100 over the fixture's 64 x 64
    messages = [{"role": "system", "content": "look"},
                {"role": "user", "content": [{"type": "text", "text": "what?"}, _part(url)]}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages.1.content.1" and error["message"].startswith("messages.1.content.1: image ")
    assert reason in error["message"]
    assert client.get("/health").json()["status"] == "ok"  # the server carries on


def test_an_image_part_without_a_url_is_a_400(served):
    client, _ = served
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages.0.content.0"


def test_a_text_model_refuses_image_parts(tiny_model_path):
    from tokenmill.engines.local.continuous import ContinuousEngine

    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=4)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    try:
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, _part("/x.png")]}]
        answer = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"].startswith("messages.0.content.1: this model reads no images")
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "images": [_part("/x.png")]})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "images"
    finally:
        server.stop()
        engine.close()


def test_the_served_example_in_docs_vision_runs(served, tmp_path, capsys):
    """docs/vision.md's "Serving" example, against this server and a picture of its own."""
    from pathlib import Path

    page = (Path(__file__).parents[4] / "docs" / "vision.md").read_text()
    mark = "<!-- tested: tests/unit/engines/server/test_vision_serving.py -->\n```python\n"
    code = page.split(mark, 1)[1].split("```", 1)[0]
    client, _ = served
    _picture((255, 0, 0)).save(tmp_path / "board.png")
    code = code.replace("http://127.0.0.1:8000", str(client.base_url).rstrip("/"))
    code = code.replace('"board.png"', repr(str(tmp_path / "board.png")))
    exec(compile(code, "docs/vision.md", "exec"), {})  # noqa: S102 - the page's own example
    printed = capsys.readouterr().out
    assert printed.count("[") == 2 and printed.strip()  # the text, the token ids, their logprobs


def test_a_remote_engine_sends_pictures_and_gets_the_in_process_samples(served, in_process):
    """`RemoteEngine(images=True)`: token ids plus data-URL `image_url` parts on /v1/completions; the served
    greedy completions and logprobs equal the in-process engine's."""
    from tokenmill.engines.remote.client import RemoteEngine

    client, _ = served
    engine, processor = in_process
    slots = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    encoded = [processor.encode(slots, [_picture((255, 0, 0))]), processor.encode(slots, [_picture((0, 0, 255), 48)]),
               processor.encode([{"role": "user", "content": "no picture"}], [])]
    remote = RemoteEngine([str(client.base_url).rstrip("/")], pad_id=0, images=True)
    assert remote.takes_images
    params = SamplingParams(max_tokens=5, n=2, greedy=True)
    try:
        got = remote.generate([ids for ids, _ in encoded], params, images=[x for _, x in encoded])
    finally:
        remote.close()
    want = engine.generate([ids for ids, _ in encoded], params, images=[x for _, x in encoded])
    for got_group, want_group in zip(got, want, strict=True):
        for g, w in zip(got_group, want_group, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert want[0][0].token_ids != want[1][0].token_ids or want[0][0].logprobs != want[1][0].logprobs


def test_completions_with_images_check_the_image_tokens(served, in_process):
    from tokenmill.engines.remote.client import image_parts

    client, _ = served
    _, processor = in_process
    slots = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    ids, inputs = processor.encode(slots, [_picture((255, 0, 0))])
    parts = image_parts(inputs)
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    bigger = image_parts(processor.pixels([_picture((255, 0, 0), 48)]))
    answer = client.post("/v1/completions", json={"prompt": ids, "images": bigger, "max_tokens": 2})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "images: the prompt has 4 image tokens for pictures that make 9"
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    answer = client.post("/v1/completions", json={"prompt": ids, "images": bad, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "images.0"
    answer = client.post("/v1/completions", json={"prompt": [ids, ids], "images": parts, "max_tokens": 2})
    assert answer.status_code == 400 and "one prompt per request" in answer.json()["error"]["message"]


def test_a_remote_engine_in_chat_sends_image_url_parts_and_gets_the_in_process_samples(served, in_process, tmp_path):
    """`RemoteEngine(image_route="chat")` (engine.placement: remote): each prompt with images goes to
    /v1/chat/completions as its messages, the image slots OpenAI `image_url` parts with data URLs of the pixels
    read here (a file path, a PIL image); the greedy completions and logprobs equal the in-process engine's."""
    from tokenmill.data.images import DEFAULT_POLICY
    from tokenmill.engines.remote.client import RemoteEngine, chat_messages
    from tokenmill.rollout.vision import encode_image_prompt

    client, _ = served
    engine, processor = in_process
    _picture((0, 0, 255), 48).save(tmp_path / "blue.png")
    rows = [{"prompt": [{"role": "user", "content": "count"}], "images": [str(tmp_path / "blue.png")]},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": _picture((255, 0, 0))},
                                                     {"type": "text", "text": "which?"}]}], "images": None},
            {"prompt": [{"role": "user", "content": "no picture"}], "images": None}]
    prompts = [encode_image_prompt(processor, row, "prompt", "images", DEFAULT_POLICY, f"row {i}")
               for i, row in enumerate(rows)]
    sent = chat_messages(prompts[0].messages, prompts[0].images)
    assert sent[0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")  # read here, not a path
    remote = RemoteEngine([str(client.base_url).rstrip("/")], pad_id=0, images=True, image_route="chat")
    params = SamplingParams(max_tokens=5, n=2, greedy=True)
    try:
        got = remote.generate(prompts, params, images=[p.images for p in prompts])
        tampered = encode_image_prompt(processor, rows[1], "prompt", "images", DEFAULT_POLICY, "row 1")
        tampered.messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "other"}]}]
        with pytest.raises(ValueError, match="rendered the chat prompt as .* tokens that differ from the run's"):
            remote.generate([tampered], params, images=[tampered.images])
        tampered.messages = None
        with pytest.raises(ValueError, match="no chat messages to send"):
            remote.generate([tampered], params, images=[tampered.images])
    finally:
        remote.close()
    want = engine.generate([list(p) for p in prompts], params, images=[p.images for p in prompts])
    for got_group, want_group in zip(got, want, strict=True):
        for g, w in zip(got_group, want_group, strict=True):
            assert g.token_ids == w.token_ids and g.text == w.text
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert want[0][0].token_ids != want[1][0].token_ids or want[0][0].logprobs != want[1][0].logprobs


def test_waiting_requests_are_decoded_together_with_their_own_seeds(served, in_process):
    """Requests that wait while the worker is busy go out as one batch; each (seeded, sampled) equals what
    the in-process engine draws for it alone."""
    _, served_engine = served
    engine, processor = in_process
    encoded = [processor.encode(_prompt_slots(text), [_picture(colour, size)])
               for text, colour, size in (("count", (255, 0, 0), 32), ("how many shapes now?", (0, 9, 200), 48),
                                          ("x", (0, 200, 0), 32))]
    params = SamplingParams(max_tokens=5, n=2, temperature=1.0)
    with served_engine._lock:  # the worker is busy: all three wait for it
        futures = [served_engine.submit(ids, params, seed=7 + i, images=x) for i, (ids, x) in enumerate(encoded)]
        assert served_engine.stats()["waiting_requests"] == 3
    groups = [f.result(timeout=120) for f in futures]
    assert served_engine.largest_batch >= 3
    for i, ((ids, x), got) in enumerate(zip(encoded, groups, strict=True)):
        engine.generator = torch.Generator().manual_seed(7 + i)
        [want] = engine.generate([ids], params, images=[x])
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def _prompt_slots(text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
