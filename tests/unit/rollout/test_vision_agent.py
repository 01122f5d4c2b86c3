"""A multi-turn episode whose observation is an image: exact token ids, and the trainer reads the same pictures."""

from __future__ import annotations

import base64
import io

import pytest
import torch

Image = pytest.importorskip("PIL.Image")


def _data_url(colour) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 48), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Screens:
    """Shows a picture, then answers each turn with a new screenshot (an image_url part); two turns."""

    def __init__(self):
        self.turns = 0

    def reset(self, task):
        return [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (32, 32), (250, 0, 0))},
                                             {"type": "text", "text": task["prompt"]}]}]

    def step(self, message):
        self.turns += 1
        observation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url((0, 0, 250))}},
                                                    {"type": "text", "text": "now?"}]}]
        return observation, float(self.turns), self.turns >= 2, {}


def test_an_image_observation_keeps_exact_token_ids_and_trainer_logprobs(tiny_vlm_path):
    from transformers import AutoModelForImageTextToText

    from tokenmill.engines.local.vision import VisionEngine, VisionProcessor, image_slots
    from tokenmill.rollout.agent import AgentLimits
    from tokenmill.rollout.vision_agent import VisionAgentLoop
    from tokenmill.training.batch import collate
    from tokenmill.training.local import batch_logprobs
    from tokenmill.types import SamplingParams

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()
    processor = VisionProcessor.from_pretrained(tiny_vlm_path)
    engine = VisionEngine(model, processor.tokenizer, seed=1)
    loop = VisionAgentLoop(engine, processor, Screens, SamplingParams(max_tokens=4, n=2),
                           AgentLimits(max_turns=4, end_on_truncation=False))
    groups, _ = loop.rollout([{"prompt": "colour?"}], version=0)
    samples = list(groups[0].samples)
    assert len(samples) == 2
    for s in samples:
        assert s.row["turns"] == 2 and s.reward == 3.0
        # the reset picture (32 px: 4 image tokens) and one screenshot (48 px: 9 tokens) after the first turn
        assert s.images.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 6]]
        ids = torch.tensor([s.tokens])
        assert int(image_slots(model, ids).sum()) == 4 + 9
        # the tokens are the prompt, each sampled turn as sampled, and the template's rendering between them
        first_turn = s.tokens[s.prompt_len:].index(processor.tokenizer.convert_tokens_to_ids("<|end|>"))
        rendered = processor.render([*s.row["messages"][:1]], merged_first(s), generation_prompt=True)
        assert list(s.tokens[: s.prompt_len]) == processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert first_turn >= 0
    batch = collate(samples, [1.0, 1.0], processor.tokenizer.pad_token_id)
    trainer = batch_logprobs(model, batch, temperature=1.0, token_budget=10_000)
    mask = batch.weights_B_T > 0
    assert int(mask.sum()) == sum(sum(s.loss_mask) for s in samples) > 2
    torch.testing.assert_close(trainer[mask], batch.old_logprobs_B_T[mask], atol=1e-5, rtol=0)


def merged_first(sample):
    """The sample's first image only (the reset's), as `ImageInputs`."""
    from tokenmill.types import ImageInputs

    grid = sample.images.image_grid_thw[:1]
    return ImageInputs(sample.images.pixel_values[: int(grid.prod())], grid)
