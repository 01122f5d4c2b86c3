"""Vision-language requests decoded together equal the same requests decoded one at a time."""

from __future__ import annotations

import pytest
import torch

from tokenmill.types import SamplingParams

pytest.importorskip("PIL")


def _picture(colour, size=32):
    from PIL import Image

    return Image.new("RGB", (size, size), colour)


def _prompt(text, images=1):
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine_and_processor(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionEngine, VisionProcessor
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", hidden_size=32, family=request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = VisionProcessor.from_pretrained(path)
    return VisionEngine(model, processor.tokenizer, seed=0), processor


def test_requests_decoded_together_equal_one_at_a_time(engine_and_processor):
    """Prompts of different lengths (left-padded together), one or two images or none, different n, max_tokens,
    temperatures and seeds, greedy beside sampled, a stop string: the same tokens, stop reasons and logprobs."""
    from tokenmill.engines.local.vision_batch import VisionRequest, decode_together

    engine, processor = engine_and_processor
    encoded = [processor.encode(_prompt("count"), [_picture((255, 0, 0))]),
               processor.encode(_prompt("which colours are there?", 2), [_picture((0, 200, 0), 48), _picture((9, 9, 9))]),
               processor.encode([{"role": "user", "content": "no picture"}], []),
               processor.encode(_prompt("again"), [_picture((0, 0, 255))])]
    params = [SamplingParams(max_tokens=6, n=2, temperature=1.0), SamplingParams(max_tokens=4, n=3, greedy=True),
              SamplingParams(max_tokens=8, n=1, temperature=0.7), SamplingParams(max_tokens=8, n=4, stop=("a",))]
    calls = engine.encoder_calls
    together = decode_together(engine, [VisionRequest(ids, p, x, torch.Generator().manual_seed(10 + i))
                                        for i, ((ids, x), p) in enumerate(zip(encoded, params, strict=True))])
    assert engine.encoder_calls - calls == 3  # each prompt's images encoded once, for all its samples
    assert [len(g) for g in together] == [2, 3, 1, 4]
    for i, ((ids, x), p) in enumerate(zip(encoded, params, strict=True)):
        engine.generator = torch.Generator().manual_seed(10 + i)
        [alone] = engine.generate([ids], p, images=[x])
        for got, want in zip(together[i], alone, strict=True):
            assert got.token_ids == want.token_ids and got.stop_reason == want.stop_reason and got.text == want.text
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert len({c.token_ids for g in together for c in g}) > 3  # the rows did not all decode the same thing
