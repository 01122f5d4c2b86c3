"""PPO's critic packs rows with images as the policy does: a group's prompt and pictures once, groups side by
side; its values and value-loss gradients equal the padded rows', and one sample's picture never reaches
another sample's values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("PIL")


def _groups(path, seed: int = 0, lengths=((3, 6, 2), (4, 60), (5, 1))):
    """Shapes prompts (a picture each), a group of sampled completions of `lengths` per prompt, the group's
    samples sharing one `ImageInputs` as a rollout's do."""
    from transformers import AutoTokenizer

    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.vision import image_sft_samples

    processor = VisionProcessor.from_pretrained(path, tokenizer=AutoTokenizer.from_pretrained(path))
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt, group in zip(image_sft_samples(processor, shapes_dataset(len(lengths), seed=seed)), lengths,
                             strict=True):
        ids = prompt.tokens[: prompt.prompt_len]
        for n in group:
            completion = tuple(torch.randint(20, 60, (n,), generator=g).tolist())
            out.append(prompt.with_(tokens=ids + completion, loss_mask=(0,) * len(ids) + (1,) * n,
                                    logprobs=(0.0,) * (len(ids) + n)))
    return out


def _batch(samples):
    from tokenmill.training.batch import collate

    batch = collate(samples, [1.0] * len(samples), 0)
    g = torch.Generator().manual_seed(3)
    return replace(batch, returns_B_T=torch.rand(batch.weights_B_T.shape, generator=g),
                   old_values_B_T=0.3 * torch.randn(batch.weights_B_T.shape, generator=g))


@pytest.fixture(scope="module")
def critic_model(tiny_vlm_path):
    """The tiny Qwen2.5-VL's critic (fp32), its vision tower trainable so its gradients are compared too, and a
    head that is not zero."""
    from tokenmill.config.schema import CriticConfig
    from tokenmill.training.critic import load_critic

    model = load_critic(CriticConfig(), tiny_vlm_path, torch.device("cpu"), freeze_vision=False)
    torch.manual_seed(1)
    with torch.no_grad():
        model.score.weight.normal_(std=0.1)
        model.score.bias.fill_(0.1)
    return model


def _critic(model, **kw):
    from tokenmill.training.critic import Critic

    return Critic(model, learning_rate=1e-3, total_steps=10, **kw)


def _encoded_patches(model):
    """A list that gathers how many patches each pass of the vision encoder reads (and the hook's handle)."""
    seen = []

    def count(module, args, kwargs, out):
        seen.append(int((args[0] if args else kwargs["hidden_states"]).shape[0]))

    return seen, model.model.visual.register_forward_hook(count, with_kwargs=True)


def _step(critic, batch):
    """(values, the value-loss gradient of one update, patches encoded)."""
    seen, hook = _encoded_patches(critic.model)
    try:
        values = critic.values(batch)
        critic.model.zero_grad(set_to_none=True)
        critic.forward_backward(batch)
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in critic.model.named_parameters() if p.grad is not None}
    return values, grads, sum(seen)


@pytest.mark.parametrize("budget", [4096, 96])
def test_packed_image_values_and_gradients_equal_padded_rows(critic_model, tiny_vlm_path, budget):
    """`training.share_prompts: false` runs padded rows; the default packs them: the same values at every trained
    token and the same value-loss gradients (vision tower and head included), each picture encoded once."""
    batch = _batch(_groups(tiny_vlm_path))
    padded, padded_grads, padded_patches = _step(_critic(critic_model, share_prompts=False,
                                                         micro_batch_tokens=budget), batch)
    packed, packed_grads, packed_patches = _step(_critic(critic_model, micro_batch_tokens=budget), batch)
    per_sample = [int(x.image_grid_thw.prod()) for x in batch.images_B]
    per_group = {id(x): n for x, n in zip(batch.images_B, per_sample, strict=True)}
    assert len(per_group) == 3 < batch.size
    assert padded_patches == 2 * sum(per_sample)  # every sample's picture, once for the values, once for the loss
    assert packed_patches == 2 * sum(per_group.values())  # every group's once
    trained = batch.weights_B_T > 0
    t = torch.arange(batch.input_ids_B_T.shape[1])[None, :]
    prompt = (t >= 1) & (t < batch.prompt_lens_B[:, None])
    assert padded[prompt].abs().min() > 0 and packed[prompt].abs().max() == 0  # packed: completion tokens only
    assert padded[trained].abs().min() > 1e-3
    torch.testing.assert_close(packed[trained], padded[trained], atol=1e-5, rtol=0)
    assert packed_grads.keys() == padded_grads.keys() and any(".visual." in n for n in packed_grads)
    assert any("score" in n for n in packed_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_another_samples_picture_never_reaches_a_packed_rows_values(critic_model, tiny_vlm_path):
    """Groups side by side in one packed row; the first group's picture changes: its values move, every other
    sample's stay bit for bit."""
    from tokenmill.training.packing import micro_packs, prompt_segments

    samples = _groups(tiny_vlm_path)
    other = _groups(tiny_vlm_path, seed=7)[0].images
    assert other.image_grid_thw.tolist() == samples[0].images.image_grid_thw.tolist()
    moved = [s.with_(images=other) if s.images is samples[0].images else s for s in samples]
    batch, moved_batch = _batch(samples), _batch(moved)
    ((_, packed),) = micro_packs(batch, 4096, prompt_segments(batch))
    assert packed.group_R_L is not None  # groups share packed rows
    critic = _critic(critic_model)
    before, after = critic.values(batch), critic.values(moved_batch)
    changed = torch.tensor([x is other for x in moved_batch.images_B])
    assert 0 < int(changed.sum()) < batch.size
    trained = batch.weights_B_T > 0
    t = torch.arange(batch.input_ids_B_T.shape[1])[None, :]
    assert before[t < batch.prompt_lens_B[:, None]].abs().max() == 0  # packed: completion tokens only
    assert (before - after)[changed][trained[changed]].abs().max() > 1e-4
    assert torch.equal(before[~changed], after[~changed])


def test_a_micro_batch_that_cannot_pack_its_pictures_runs_padded(critic_model, tiny_vlm_path):
    """A completion ending in a vision-start token packed before one starting with image tokens would make those
    sampled tokens a picture slot (`training.vision.packed_pictures` refuses): that micro-batch's values are the
    padded rows', prompt tokens included."""
    from tokenmill.training.packing import micro_packs, prompt_segments
    from tokenmill.training.vision import packed_pictures

    samples = _groups(tiny_vlm_path, lengths=((5,),))  # longest first: the vision start packs right before the image tokens
    c = critic_model.config
    prompt = samples[0]
    ids = prompt.tokens[: prompt.prompt_len]
    for completion in ((30, 31, 32, c.vision_start_token_id), (c.image_token_id, c.image_token_id, 33)):
        samples.append(prompt.with_(tokens=ids + completion, loss_mask=(0,) * len(ids) + (1,) * len(completion),
                                    logprobs=(0.0,) * (len(ids) + len(completion))))
    batch = _batch(samples)
    ((micro, packed),) = micro_packs(batch, 4096, prompt_segments(batch))
    assert packed_pictures(critic_model, micro, packed) is None
    packed_values = _critic(critic_model).values(batch)
    padded_values = _critic(critic_model, share_prompts=False).values(batch)
    t = torch.arange(batch.input_ids_B_T.shape[1])[None, :]
    assert packed_values[(t >= 1) & (t < batch.prompt_lens_B[:, None])].abs().min() > 0  # prompt tokens: padded
    torch.testing.assert_close(packed_values, padded_values, atol=1e-6, rtol=0)


def _varied(completions, **columns):
    """A reward that differs within groups, so the critic has returns to learn."""
    return [float(len(str(c)) % 3) for c in completions]


def test_a_ppo_step_on_shapes_values_the_same_packed_or_padded(tiny_vlm_path, tmp_path, monkeypatch):
    """PPO on the shapes task with groups of 3: the first step's critic value loss and gradient norm are the same
    with packed rows (the default, which the critic takes) as with padded ones (`training.share_prompts: false`)."""
    import json

    import tokenmill
    from tokenmill.training import vision_roles

    packs = {True: 0, False: 0}
    share = True
    run = vision_roles.packed_image_values

    def counted(*args, **kwargs):
        packs[share] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(vision_roles, "packed_image_values", counted)
    rows = {}
    for share in (True, False):
        out = tmp_path / f"share-{share}"
        tokenmill.train({
            "model": {"path": tiny_vlm_path},
            "algorithm": {"advantage": "gae"},
            "critic": {"learning_rate": 3e-3},
            "data": {"task": "shapes", "num_train": 16, "num_eval": 0},
            "generation": {"group_size": 3, "max_tokens": 4},
            "controller": {"steps": 1, "prompts_per_step": 3},
            "training": {"share_prompts": share, "micro_batch_tokens": 128},
            "tracking": {"output_dir": str(out), "console": "none"},
            "checkpoint": {"every": 0},
        }, rewards=[_varied])
        rows[share] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert packs[True] > 0 and packs[False] == 0
    packed, padded = rows[True][0], rows[False][0]
    assert padded["critic/grad_norm"] > 0 and padded["reward/mean"] == packed["reward/mean"]
    for key in ("critic/value_loss", "critic/grad_norm", "critic/return_mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
