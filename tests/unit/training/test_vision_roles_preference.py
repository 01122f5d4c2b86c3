"""DPO with images (TRL's vision preference format): the sequence logprobs and the loss are those of a plain
forward with the pictures, and the margin rises over a few steps on pairs built from the shapes task."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("PIL")


def _policy(path):
    from tokenmill.config.schema import ModelConfig
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.vision_roles import PairImages

    model, tok = load_policy(ModelConfig(path=path), resolve_device("cpu"))
    return model, tok, PairImages(VisionProcessor.from_pretrained(path, tokenizer=tok))


def _hand_sums(model, images, rows):
    """Each pair's (chosen, rejected) summed completion logprobs from the model's own forward with the pixels."""
    from tokenmill.testing.reference import image_token_logprobs

    samples = images.samples(rows)
    sums = []
    for s in samples:
        lp = image_token_logprobs(model, s.tokens, s.images)
        sums.append(float(lp[s.prompt_len - 1 :].sum()))  # the completion and its end-of-sequence token
    p = len(rows)
    return torch.tensor(sums[:p]), torch.tensor(sums[p:])


def test_dpo_with_images_is_the_loss_of_a_plain_forward_with_the_pictures(tiny_vlm_path):
    from tokenmill.algorithms.preference import dpo_loss
    from tokenmill.data.formats import pair_rows
    from tokenmill.data.shapes import shapes_preferences
    from tokenmill.training.preference import pair_logprobs, preference_loss, reference_pair_logprobs

    model, tok, images = _policy(tiny_vlm_path)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():  # the policy one step away from its reference
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    rows = pair_rows(tok, shapes_preferences(4, seed=0))
    assert all(s.images is not None for s in images.samples(rows))
    policy_lp = pair_logprobs(model, tok, rows, images=images)
    ref_lp = reference_pair_logprobs(model, reference, tok, rows, images)
    loss, _ = preference_loss("dpo", policy_lp, ref_lp, beta=0.5)

    chosen, rejected = _hand_sums(model.eval(), images, rows)
    ref_chosen, ref_rejected = _hand_sums(reference, images, rows)
    assert torch.allclose(policy_lp[0], chosen, atol=1e-5) and torch.allclose(policy_lp[1], rejected, atol=1e-5)
    want, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    assert abs(float(loss.detach()) - float(want)) < 1e-5
    assert abs(float(want) - 0.6931) > 1e-3  # not the loss of a policy equal to its reference
    # the text alone scores otherwise: the pictures are read
    text_lp = pair_logprobs(model, tok, rows)
    assert (text_lp[0] - policy_lp[0]).abs().max() > 1e-3


def test_the_margin_rises_over_a_few_dpo_steps_on_shape_pairs(tiny_vlm_path):
    from tokenmill.data.formats import pair_rows
    from tokenmill.data.shapes import shapes_preferences
    from tokenmill.training.preference import frozen_reference, implicit_margin, run_dpo

    model, tok, images = _policy(tiny_vlm_path)
    train = shapes_preferences(16, seed=0)
    reference = frozen_reference(model)
    before = implicit_margin(model, reference, tok, pair_rows(tok, train), images=images)
    losses = run_dpo(model, tok, train, steps=6, beta=0.5, batch_size=16, learning_rate=3e-3, warmup_steps=0,
                     images=images)
    after = implicit_margin(model, reference, tok, pair_rows(tok, train), images=images)
    print("losses", [round(x, 4) for x in losses], "margin", before["margin"], "->", after["margin"])
    assert abs(before["margin"]) < 1e-6 and after["margin"] > 0.1
    assert losses[-1] < losses[0]
