"""Packed rows with images: logprobs and gradients equal the padded rows', and samples never see each other."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")


@pytest.fixture(params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def each_vlm(request, tiny_vlm_path, qwen2_vl_path, qwen3_vl_path):
    """Qwen2.5-VL, Qwen2-VL and Qwen3-VL (its deepstack features too), fp32, every parameter trainable (the
    vision tower's gradients are compared too)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor

    path = {"qwen2_5_vl": tiny_vlm_path, "qwen2_vl": qwen2_vl_path, "qwen3_vl": qwen3_vl_path}[request.param]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).train()
    return model, VisionProcessor.from_pretrained(path)


def _picture(colour, size=32):
    from PIL import Image

    image = Image.new("RGB", (size, size), colour)
    image.paste((255 - colour[0], 128, colour[2] // 2), (4, 4, size // 2, size // 3))  # not one flat colour
    return image


def _joined(first, second):
    from tokenmill.types import ImageInputs

    return ImageInputs(torch.cat([first.pixel_values, second.pixel_values]),
                       torch.cat([first.image_grid_thw, second.image_grid_thw]))


def _samples(processor, seed: int = 0, colour=(200, 30, 30)):
    """Groups of different prompt lengths and picture counts (1, 2, 0), completions of different lengths, a lone
    sample, and an episode whose completion holds an observation picture (image tokens after the prompt)."""
    from tokenmill.types import Sample, StopReason

    g = torch.Generator().manual_seed(seed)
    start, pad, end = (processor.tokenizer.convert_tokens_to_ids(t)
                       for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))

    def text(n):
        return torch.randint(20, 60, (n,), generator=g).tolist()

    def sample(ids, completion, inputs, trained=None):
        mask = trained if trained is not None else [1] * len(completion)
        return Sample(tokens=tuple(ids + completion), loss_mask=(0,) * len(ids) + tuple(mask),
                      logprobs=(0.0,) * (len(ids) + len(completion)), prompt_len=len(ids), prompt=None, completion="",
                      stop_reason=StopReason.STOP, images=inputs)

    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                        {"type": "image"}, {"type": "text", "text": "same?"}]}]
    ids1, x1 = processor.encode(one, [_picture(colour)])
    ids2, x2 = processor.encode(two, [_picture((20, 160, 40), 48), _picture((10, 10, 220), 32)])
    ids0, _ = processor.encode([{"role": "user", "content": "no picture here"}], [])
    ids3, x3 = processor.encode(one, [_picture((90, 90, 0), 40)])
    obs = processor.pixels([_picture((0, 120, 120), 32)])
    seen = int(obs.image_grid_thw.prod()) // processor.merge**2
    picture = [start] + [pad] * seen + [end]
    episode = text(2) + picture + text(3)
    trained = [1, 1] + [0] * len(picture) + [1, 1, 1]
    return ([sample(ids1, text(n), x1) for n in (3, 7, 5)] + [sample(ids2, text(n), x2) for n in (4, 30)]
            + [sample(ids0, text(n), None) for n in (6, 2)] + [sample(ids3, text(8), x3)]
            + [sample(ids1, episode, _joined(x1, obs), trained)])


def _batch(processor, **kw):
    from tokenmill.training.batch import collate

    samples = _samples(processor, **kw)
    return collate(samples, [1.0] * len(samples), processor.tokenizer.pad_token_id)


def _encoded_patches(model):
    """A counter of the patches the vision encoder reads (how many pictures a pass encodes)."""
    from tokenmill.engines.local.vision import vision_tower

    seen = []
    def count(module, args, kwargs, out):
        seen.append(int((args[0] if args else kwargs["hidden_states"]).shape[0]))

    vision_tower(model).register_forward_hook(count, with_kwargs=True)
    return seen


def _step(model, batch, **kw):
    """Per-token logprobs and the gradient of the weighted logprob sum over micro-batches (one update's)."""
    from tokenmill.training.local import micro_token_stats

    model.zero_grad(set_to_none=True)
    out = torch.zeros_like(batch.old_logprobs_B_T)
    for rows, micro, lp, ent in micro_token_stats(model, batch, temperature=0.7, entropy=True, **kw):
        ((lp * micro.weights_B_T).sum() + 0.1 * (ent * micro.weights_B_T).sum()).backward()
        out[rows, : lp.shape[1]] = lp.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("budget", [4096, 96])
def test_packed_image_batches_equal_padded_rows(each_vlm, budget):
    """Shared prompts with their pictures once, groups side by side: the same logprobs and gradients (vision tower
    included) as length-bucketed padded rows, in fewer tokens and fewer encoded patches."""
    model, processor = each_vlm
    batch = _batch(processor)
    patches = _encoded_patches(model)
    padded, padded_grads = _step(model, batch, token_budget=budget, share_prompts=False)
    padded_patches, patches[:] = sum(patches), []
    packed, packed_grads = _step(model, batch, token_budget=budget)
    assert sum(patches) < padded_patches  # each group's pictures were encoded once, not once per sample
    trained = batch.weights_B_T > 0
    assert int(trained.sum()) > 40
    torch.testing.assert_close(packed[trained], padded[trained], atol=1e-5, rtol=0)
    assert packed_grads.keys() == padded_grads.keys() and any(".visual." in n for n in packed_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_micro_batches_count_image_tokens_in_the_budget(tiny_vlm_path):
    """The token budget counts image tokens: every packed micro-batch (rows x width) fits it, and a budget too
    small for two groups' pictures splits them."""
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.local import packing_segments
    from tokenmill.training.packing import micro_packs

    batch = _batch(VisionProcessor.from_pretrained(tiny_vlm_path))
    segments = packing_segments(batch, share_prompts=True, pack_sequences=False)
    assert len(segments) == 5  # the episode's observation picture makes it its own group
    for budget in (64, 96, 4096):
        micro = list(micro_packs(batch, budget, segments))
        for _, packed in micro:
            rows, width = packed.input_ids_R_L.shape
            assert rows * width <= budget or rows == 1
        assert sorted(b for sub, packed in micro for b in packed.batch_rows.tolist()) == list(range(batch.size))
    assert len(list(micro_packs(batch, 64, segments))) > len(list(micro_packs(batch, 4096, segments))) == 1


def test_whole_sequences_packed_side_by_side_equal_padded_rows(tiny_vlm_path):
    """`pack_sequences` (SFT): every sample's own positions and pictures, side by side in a row."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.packing import micro_packs, sequence_segments

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    batch = _batch(VisionProcessor.from_pretrained(tiny_vlm_path))
    ((_, packed),) = micro_packs(batch, 4096, sequence_segments(batch))
    assert packed.input_ids_R_L.shape[0] < batch.size  # several samples in one row
    padded, padded_grads = _step(model, batch, token_budget=4096, share_prompts=False)
    packed_lp, packed_grads = _step(model, batch, token_budget=4096, pack_sequences=True)
    predicted = torch.arange(batch.input_ids_B_T.shape[1])[None, :].expand_as(padded)
    predicted = (predicted >= 1) & (predicted < batch.lengths_B[:, None])
    torch.testing.assert_close(packed_lp[predicted], padded[predicted], atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_attention_by_segments_with_images_equals_the_dense_mask(tiny_vlm_path):
    """Rows wide enough to attend by segments (`training.segment_attention`) give the dense mask's numbers."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.packing import pack, plan_rows, prompt_segments
    from tokenmill.training.vision import packed_vision_stats

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    batch = _batch(VisionProcessor.from_pretrained(tiny_vlm_path))
    packed = pack(batch, [[row] for row in plan_rows(batch, 4096, prompt_segments(batch))])
    assert packed.layout  # one group per row: the segment index applies
    with torch.no_grad():
        dense, _ = packed_vision_stats(model, batch, packed, temperature=1.0, chunk_bytes=1 << 20)
        segmented, _ = packed_vision_stats(model, batch, packed, temperature=1.0, chunk_bytes=1 << 20, min_width=1)
    trained = batch.weights_B_T > 0
    assert dense[trained].abs().min() > 0
    torch.testing.assert_close(segmented[trained], dense[trained], atol=1e-5, rtol=0)


def test_another_samples_picture_never_leaks_into_a_packed_row(tiny_vlm_path):
    """Change the pictures of one group: its logprobs change, every other sample's in the same packed rows do
    not (bit for bit in one forward layout)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.local import batch_logprobs
    from tokenmill.training.packing import micro_packs, prompt_segments

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    processor = VisionProcessor.from_pretrained(tiny_vlm_path)
    batch, other = _batch(processor), _batch(processor, colour=(10, 240, 90))
    ((_, packed),) = micro_packs(batch, 4096, prompt_segments(batch))
    assert packed.group_R_L is not None  # groups share packed rows
    assert torch.equal(batch.input_ids_B_T, other.input_ids_B_T)
    before = batch_logprobs(model, batch, temperature=1.0, token_budget=4096)
    after = batch_logprobs(model, other, temperature=1.0, token_budget=4096)
    changed = [i for i, s in enumerate(batch.images_B) if s is not None and not torch.equal(
        s.pixel_values[:16], other.images_B[i].pixel_values[:16])]
    assert changed and len(changed) < batch.size
    trained = batch.weights_B_T > 0
    kept = torch.ones(batch.size, dtype=torch.bool)
    kept[changed] = False
    assert (before - after)[changed][trained[changed]].abs().max() > 1e-4
    assert torch.equal(before[kept], after[kept])


def _varied(completions, **columns):
    """A reward that differs within groups (the random tiny model never counts right), so the step has a loss."""
    return [float(len(str(c)) % 3) for c in completions]


def test_a_grpo_step_on_shapes_packed_equals_padded(tiny_vlm_path, tmp_path):
    """GRPO on the shapes task: the first step's loss and gradient norm are the same with packed rows (the
    default) as with padded ones (`training.share_prompts: false`); the same samples are drawn in both."""
    import json

    import tokenmill

    rows = {}
    for share in (True, False):
        out = tmp_path / f"share-{share}"
        tokenmill.train({
            "model": {"path": tiny_vlm_path, "freeze_vision": False},
            "data": {"task": "shapes", "num_train": 16, "num_eval": 0},
            "generation": {"group_size": 4, "max_tokens": 4},
            "controller": {"steps": 2, "prompts_per_step": 3},
            "training": {"share_prompts": share, "micro_batch_tokens": 128},
            "tracking": {"output_dir": str(out), "console": "none"},
            "checkpoint": {"every": 0},
        }, rewards=[_varied])
        rows[share] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    packed, padded = rows[True][0], rows[False][0]
    assert padded["grad_norm"] > 0 and padded["reward/std"] > 0
    assert packed["mismatch/max_abs"] < 1e-5  # the packed trainer's logprobs are the sampler's
    assert packed["reward/mean"] == padded["reward/mean"]
    for key in ("loss", "grad_norm", "entropy"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    assert len(rows[True]) == len(rows[False]) == 2


def test_a_micro_batch_whose_rows_would_join_image_tokens_runs_padded(tiny_vlm_path):
    """A completion ending in a vision-start token packed before one starting with image tokens would make those
    sampled tokens a picture slot; that micro-batch runs as padded rows, with the padded rows' numbers."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.training.packing import micro_packs, prompt_segments
    from tokenmill.training.vision import packed_pictures
    from tokenmill.types import Sample, StopReason

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    processor = VisionProcessor.from_pretrained(tiny_vlm_path)
    c = model.config
    samples = _samples(processor)[:3]
    ids, _ = processor.encode([{"role": "user", "content": "draw"}], [])
    for completion in ([30, 31, 32, c.vision_start_token_id], [c.image_token_id, c.image_token_id, 33]):
        samples.append(Sample(tokens=tuple(ids + completion), loss_mask=(0,) * len(ids) + (1,) * len(completion),
                              logprobs=(0.0,) * (len(ids) + len(completion)), prompt_len=len(ids), prompt=None,
                              completion="", stop_reason=StopReason.STOP))
    batch = collate(samples, [1.0] * len(samples), processor.tokenizer.pad_token_id)
    ((micro, packed),) = micro_packs(batch, 4096, prompt_segments(batch))
    assert packed_pictures(model, micro, packed) is None
    trained = batch.weights_B_T > 0
    packed_lp = batch_logprobs(model, batch, temperature=1.0, token_budget=4096)
    padded_lp = batch_logprobs(model, batch, temperature=1.0, token_budget=4096, share_prompts=False)
    torch.testing.assert_close(packed_lp[trained], padded_lp[trained], atol=1e-6, rtol=0)
