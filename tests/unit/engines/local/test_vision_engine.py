"""The vision-language engine: images encoded once per group, and its logprobs equal the trainer's."""

from __future__ import annotations

import pytest
import torch

from tokenmill.types import SamplingParams

pytest.importorskip("PIL")


def _picture(colour, size=32):
    from PIL import Image

    return Image.new("RGB", (size, size), colour)


def _load(path):
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, VisionProcessor.from_pretrained(path)


@pytest.fixture
def vlm(tiny_vlm_path):
    return _load(tiny_vlm_path)


@pytest.fixture(params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def each_vlm(request, tiny_vlm_path, qwen2_vl_path, qwen3_vl_path):
    """Qwen2.5-VL, Qwen2-VL and Qwen3-VL."""
    return _load({"qwen2_5_vl": tiny_vlm_path, "qwen2_vl": qwen2_vl_path, "qwen3_vl": qwen3_vl_path}[request.param])


def _prompt(text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_processor_expands_each_image_to_its_tokens(vlm):
    model, processor = vlm
    ids, inputs = processor.encode(_prompt("hi"), [_picture((255, 0, 0)), _picture((0, 0, 255), 48)][:1])
    grid = inputs.image_grid_thw.tolist()
    assert grid == [[1, 4, 4]]  # 32 px / 8 px patches; the merger joins 2 x 2 into one token
    assert ids.count(model.config.image_token_id) == 4
    two, inputs2 = processor.encode(_prompt("a") + [{"role": "user", "content": [{"type": "image"}]}],
                                    [_picture((255, 0, 0)), _picture((0, 0, 255), 48)])
    assert inputs2.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 6]]
    assert two.count(model.config.image_token_id) == 4 + 9


def test_engine_logprobs_equal_trainer_logprobs_with_images(each_vlm):
    """The sampler's logprob of every completion token equals the trainer's recomputation (fp32, 1e-5)."""
    from tokenmill.engines.local.vision import VisionEngine
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.types import Sample, StopReason

    model, processor = each_vlm
    engine = VisionEngine(model, processor.tokenizer, seed=3)
    encoded = [processor.encode(_prompt("count"), [_picture((255, 0, 0))]),
               processor.encode(_prompt("which colour?"), [_picture((0, 200, 0), 48)])]
    params = SamplingParams(max_tokens=6, temperature=1.0, n=3)
    groups = engine.generate([ids for ids, _ in encoded], params, images=[x for _, x in encoded])
    assert engine.encoder_calls == 2  # once per prompt, not once per sample
    samples = []
    for (ids, inputs), group in zip(encoded, groups, strict=True):
        for c in group:
            samples.append(Sample(tokens=tuple(ids) + c.token_ids, loss_mask=(0,) * len(ids) + (1,) * len(c.token_ids),
                                  logprobs=(0.0,) * len(ids) + c.logprobs, prompt_len=len(ids), prompt=None,
                                  completion=c.text, stop_reason=StopReason.STOP, images=inputs))
    batch = collate(samples, [1.0] * len(samples), processor.tokenizer.pad_token_id)
    trainer = batch_logprobs(model, batch, temperature=1.0, token_budget=10_000)
    mask = batch.weights_B_T > 0
    assert int(mask.sum()) == sum(len(c.token_ids) for g in groups for c in g)
    torch.testing.assert_close(trainer[mask], batch.old_logprobs_B_T[mask], atol=1e-5, rtol=0)
    # micro-batches of one row give the same numbers as one micro-batch
    one_by_one = batch_logprobs(model, batch, temperature=1.0, token_budget=1)
    torch.testing.assert_close(one_by_one[mask], trainer[mask], atol=1e-6, rtol=0)


def test_the_image_changes_the_logprobs(vlm):
    """The trainer reads the pixels: another picture gives other logprobs for the same tokens."""
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.types import Sample, StopReason

    model, processor = vlm
    rows = []
    for colour in ((255, 0, 0), (0, 0, 255)):
        ids, inputs = processor.encode(_prompt("x"), [_picture(colour)])
        tokens = tuple(ids) + (20, 21, 22)
        rows.append(Sample(tokens=tokens, loss_mask=(0,) * len(ids) + (1,) * 3, logprobs=(0.0,) * len(tokens),
                           prompt_len=len(ids), prompt=None, completion="", stop_reason=StopReason.STOP, images=inputs))
    lp = batch_logprobs(model, collate(rows, [1.0, 1.0], 0), temperature=1.0, token_budget=10_000)
    assert (lp[0, -3:] - lp[1, -3:]).abs().max() > 1e-4


def test_only_the_processors_image_tokens_are_image_slots(vlm):
    """An image token the policy sampled (in a completion) is text: only runs after vision-start hold pictures."""
    from tokenmill.engines.local.vision import image_slots
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.types import Sample, StopReason

    model, processor = vlm
    c = model.config
    ids = torch.tensor([[30, c.vision_start_token_id, c.image_token_id, c.image_token_id, c.vision_end_token_id,
                         c.image_token_id, 31, c.image_token_id]])
    assert image_slots(model, ids).tolist() == [[False, False, True, True, False, False, False, False]]
    prompt, inputs = processor.encode(_prompt("x"), [_picture((255, 0, 0))])
    tokens = (*prompt, c.image_token_id, 25, c.image_token_id)  # the completion holds sampled image tokens
    sample = Sample(tokens=tokens, loss_mask=(0,) * len(prompt) + (1,) * 3, logprobs=(0.0,) * len(tokens),
                    prompt_len=len(prompt), prompt=None, completion="", stop_reason=StopReason.STOP, images=inputs)
    lp = batch_logprobs(model, collate([sample], [1.0], 0), temperature=1.0, token_budget=10_000)
    assert torch.isfinite(lp).all() and (lp[0, -3:] < 0).all()


def test_qwen3_vl_logprobs_equal_the_models_own_forward(qwen3_vl_path, monkeypatch):
    """The trainer's Qwen3-VL forward (image features and deepstack features at the image slots, the model's
    interleaved multimodal positions) gives the logprobs of transformers' own forward with the processor's
    `mm_token_type_ids`, and the deepstack features take part (dropping them changes the numbers)."""
    from tokenmill.engines.local import vision
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.types import Sample, StopReason

    model, processor = _load(qwen3_vl_path)
    ids, inputs = processor.encode(_prompt("how many?"), [_picture((255, 0, 0), 48)])
    tokens = (*ids, 20, 21, 22, 23)
    sample = Sample(tokens=tokens, loss_mask=(0,) * len(ids) + (1,) * 4, logprobs=(0.0,) * len(tokens),
                    prompt_len=len(ids), prompt=None, completion="", stop_reason=StopReason.STOP, images=inputs)
    ours = batch_logprobs(model, collate([sample], [1.0], 0), temperature=1.0, token_budget=10_000)[0, -4:]
    ids_1_T = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids_1_T, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                       mm_token_type_ids=vision.image_slots(model, ids_1_T).int()).logits
    theirs = logits[0, -5:-1].log_softmax(-1).gather(-1, ids_1_T[0, -4:, None])[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert vision.deepstack_inputs(type("Out", (), {"deepstack_features": []})(), ids_1_T) == {}
    monkeypatch.setattr(vision, "deepstack_inputs", lambda encoded, slots: {})
    without = batch_logprobs(model, collate([sample], [1.0], 0), temperature=1.0, token_budget=10_000)[0, -4:]
    assert (without - ours).abs().max() > 1e-4
