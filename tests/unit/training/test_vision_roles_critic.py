"""PPO's critic over a vision-language policy sees the images: its values equal a plain forward of the same
model with the pixels, and change with the picture; PPO runs on the shapes task with the critic learning."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")


def _image_samples(path, rows):
    from transformers import AutoTokenizer

    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.vision import image_sft_samples

    processor = VisionProcessor.from_pretrained(path, tokenizer=AutoTokenizer.from_pretrained(path))
    return image_sft_samples(processor, rows)


def _critic(path):
    from tokenmill.config.schema import CriticConfig
    from tokenmill.training.critic import Critic, load_critic

    model = load_critic(CriticConfig(), path, torch.device("cpu"))
    torch.manual_seed(1)
    with torch.no_grad():  # a head that is not zero, so the values say something
        model.score.weight.normal_(std=1.0)
        model.score.bias.fill_(0.1)
    return Critic(model, learning_rate=1e-3, total_steps=10)


def test_a_vision_critic_values_the_images_like_a_plain_forward(tiny_vlm_path):
    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.training.batch import collate
    from tokenmill.training.vision_roles import VisionValueModel

    critic = _critic(tiny_vlm_path)
    assert isinstance(critic.model, VisionValueModel)
    assert not any(p.requires_grad for p in critic.model.model.visual.parameters())  # the tower frozen
    samples = _image_samples(tiny_vlm_path, shapes_dataset(3, seed=0))
    batch = collate(samples, [1.0] * len(samples), 0)
    values_B_T = critic.values(batch)
    for b, i in enumerate(batch.sample_index_B.tolist()):
        s = samples[i]
        with torch.no_grad():
            ids = torch.tensor([s.tokens])  # the processor's token types: 1 at the image tokens
            kinds = (ids == critic.model.config.image_token_id).int()
            hidden = critic.model.model(input_ids=ids, pixel_values=s.images.pixel_values, mm_token_type_ids=kinds,
                                        image_grid_thw=s.images.image_grid_thw).last_hidden_state
            want = critic.model.score(hidden)[0, :-1, 0]
        n = len(s.tokens)
        assert torch.allclose(values_B_T[b, 1:n], want, atol=1e-5), (values_B_T[b, 1:n] - want).abs().max()
    # another picture behind the same tokens: other values
    other = _image_samples(tiny_vlm_path, shapes_dataset(3, seed=7))
    pairs = [(s, o) for s, o in zip(samples, other, strict=True)
             if s.images.image_grid_thw.tolist() == o.images.image_grid_thw.tolist()]
    assert pairs
    moved = critic.values(collate([s.with_(images=o.images) for s, o in pairs], [1.0] * len(pairs), 0))
    same = critic.values(collate([s for s, _ in pairs], [1.0] * len(pairs), 0))
    assert (moved - same).abs().max() > 1e-4


def test_ppo_with_a_critic_runs_on_the_shapes_task(tmp_path, tiny_vlm_path):
    import json
    import math

    import tokenmill

    def shapes_on_the_board(completions, answer, **_):  # what the picture holds: a value to learn from it
        return [int(a) / 4 for a in answer]

    out = tmp_path / "run"
    tokenmill.train({
        "model": {"path": tiny_vlm_path},
        "algorithm": {"advantage": "gae"},
        "critic": {"learning_rate": 3e-3},
        "data": {"task": "shapes", "num_train": 32, "num_eval": 4},
        "generation": {"group_size": 1, "max_tokens": 3},
        "controller": {"steps": 6, "prompts_per_step": 8},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0},
    }, rewards=[shapes_on_the_board])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/value_loss" in r or "value_loss" in r]
    losses = [r["critic/value_loss"] for r in rows]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    print("value losses", [round(x, 4) for x in losses])
    assert all(math.isfinite(r["loss"]) and r["critic/grad_norm"] > 0 for r in rows)  # finite, the critic trains


def test_a_lora_critic_adapts_the_language_model_and_trains_its_head(tiny_vlm_path):
    from tokenmill.config.schema import CriticConfig
    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.training.batch import collate
    from tokenmill.training.critic import Critic, load_critic

    model = load_critic(CriticConfig(lora={"rank": 4}), tiny_vlm_path, torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)
    adapters = [n for n in trainable if "lora_" in n]
    assert adapters and all("language_model" in n for n in adapters)
    critic = Critic(model, learning_rate=1e-2, total_steps=4)
    samples = _image_samples(tiny_vlm_path, shapes_dataset(4, seed=0))
    batch = collate(samples, [1.0] * len(samples), 0)
    batch = batch.__class__(**{**batch.__dict__, "returns_B_T": torch.ones_like(batch.weights_B_T),
                               "old_values_B_T": torch.zeros_like(batch.weights_B_T)})
    losses = []
    for _ in range(4):
        losses.append(critic.forward_backward(batch)["value_loss"])
        critic.optim_step()
    assert losses[-1] < losses[0]
