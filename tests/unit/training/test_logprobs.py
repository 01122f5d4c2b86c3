"""The chunked LM head (`training.logprobs`) gives the full-logits path's logprobs, entropies and gradients
(1e-6 in fp32): for the RL loss (padded and shared-prompt packed), SFT packing, DPO, LoRA and an untied head."""

from __future__ import annotations

import pytest
import torch

from tokenmill.algorithms import token_weights
from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import LocalBackend, collate
from tokenmill.training.logprobs import head_parts, sequence_token_stats, token_entropy, token_logprobs
from tokenmill.training.update import _batch_loss
from tokenmill.types import Sample

TOL = {"atol": 1e-6, "rtol": 1e-6}  # fp32: equal up to rounding (entropies are ~4)


def _same_grad(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within 1e-6 of the tensor's scale: the chunks sum a weight's gradient in another order (the embedding's,
    of size ~10 here, differs by ~2e-6 in its last bits)."""
    err = float((got - want).abs().max())
    assert err <= 1e-6 * max(1.0, float(want.abs().max())), f"{name}: {err}"


def _samples(vocab: int, seed: int = 0) -> list[Sample]:
    """Three prompts of 2-5 tokens with 2-4 completions of 1-7 tokens each; random advantages and old logprobs."""
    return uneven_groups(seed, vocab, ((2, 4, 7), (4, 3, 7), (5, 2, 7)))


def _chunk_mib(model, tokens: int) -> float:
    """A chunk budget of `tokens` positions for this model's vocabulary (so the tiny model runs many chunks)."""
    return tokens * 4 * model.config.vocab_size / 2**20


def _load(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunked_stats_and_gradients_equal_full_logits(tiny_model_path, tokenizer):
    samples = _samples(len(tokenizer))
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    ids, real = batch.input_ids_B_T, batch.weights_B_T > 0
    out = {}
    for chunk in (0, 3):
        model = _load(tiny_model_path)
        assert head_parts(model) is not None
        lp, ent = sequence_token_stats(model, ids, lengths_B=batch.lengths_B, temperature=0.7, entropy=True,
                                       entropy_grad=True, chunk_bytes=chunk * 4 * model.config.vocab_size)
        ((lp * batch.weights_B_T).sum() + 0.3 * (ent * batch.weights_B_T).sum()).backward()
        out[chunk] = lp, ent, _grads(model)
    (lp0, ent0, g0), (lp3, ent3, g3) = out[0], out[3]
    # the plain path is the hand-written full-logits formula
    with torch.no_grad():
        logits = _load(tiny_model_path)(input_ids=ids).logits
    torch.testing.assert_close(lp0, token_logprobs(logits, ids, 0.7), **TOL)
    torch.testing.assert_close(lp3[real], lp0[real], **TOL)
    torch.testing.assert_close(ent3[real], ent0[real], **TOL)
    torch.testing.assert_close(ent0, token_entropy(logits, 0.7), **TOL)
    padding = torch.arange(ids.shape[1])[None, :] >= batch.lengths_B[:, None]
    assert bool(padding.any()) and bool((lp3[padding] == 0).all()) and float(lp3[real].detach().sum()) < -10
    assert set(g3) == set(g0) and "lm_head.weight" not in g3  # the tiny model ties its head to the embeddings
    for name in g0:
        _same_grad(g3[name], g0[name], name)


@pytest.mark.parametrize("share", [True, False])
def test_backend_rl_update_equal_with_and_without_chunks(tiny_model_path, tokenizer, share):
    """PPO-clip loss with an entropy bonus through `LocalBackend`: metrics and gradients match."""
    samples = _samples(len(tokenizer), seed=1)
    batch = collate(samples, token_weights([sum(s.loss_mask) for s in samples], "token_mean"), pad_id=0)
    runs = {}
    for chunked in (False, True):
        model = _load(tiny_model_path)
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=40, share_prompts=share,
                               temperature=0.8, logits_chunk_mib=_chunk_mib(model, 4) if chunked else 0)
        metrics = backend.forward_backward(batch, _batch_loss("ppo_clip", AlgorithmConfig()), entropy_coef=0.1)
        runs[chunked] = metrics, _grads(model), backend.forward(batch)
    (m0, g0, lp0), (m1, g1, lp1) = runs[False], runs[True]
    for key in ("loss", "entropy", "ratio_mean", "weight"):
        assert m1[key] == pytest.approx(m0[key], abs=1e-6), key
    trained = batch.weights_B_T > 0
    torch.testing.assert_close(lp1[trained], lp0[trained], **TOL)
    assert abs(m0["loss"]) > 1e-3 and g0
    for name in g0:
        _same_grad(g1[name], g0[name], name)


def test_sft_packed_update_equal_with_and_without_chunks(tiny_model_path, tokenizer):
    from tokenmill.training.sft import _loss

    samples = _samples(len(tokenizer), seed=2)
    batch = collate(samples, token_weights([sum(s.loss_mask) for s in samples], "token_mean"), pad_id=0)
    runs = {}
    for chunked in (False, True):
        model = _load(tiny_model_path)
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=24, track_entropy=False,
                               share_prompts=False, pack_sequences=True,
                               logits_chunk_mib=_chunk_mib(model, 5) if chunked else 0)
        runs[chunked] = backend.forward_backward(batch, _loss)["nll"], _grads(model)
    (nll0, g0), (nll1, g1) = runs[False], runs[True]
    assert nll1 == pytest.approx(nll0, abs=1e-6) and nll0 > 1.0
    for name in g0:
        _same_grad(g1[name], g0[name], name)


def test_dpo_loss_and_gradients_equal_with_and_without_chunks(tiny_model_path, tokenizer):
    from tokenmill.training.preference import pair_logprobs, preference_loss

    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in ((3, 4), (12, 9),
                                                                                               (50, 50), (7, 71))]
    reference = pair_logprobs(_load(tiny_model_path), tokenizer, rows, chunk_bytes=0)
    runs = {}
    for chunk in (0, 2):
        model = _load(tiny_model_path)
        policy = pair_logprobs(model, tokenizer, rows, chunk_bytes=chunk * 4 * model.config.vocab_size)
        loss, _ = preference_loss("dpo", policy, tuple(r.detach() * 0.9 for r in reference), beta=0.1)
        loss.backward()
        runs[chunk] = policy, loss.item(), _grads(model)
    (p0, l0, g0), (p2, l2, g2) = runs[0], runs[2]
    for a, b in zip(p0, p2, strict=True):
        torch.testing.assert_close(b, a, **TOL)
    assert l2 == pytest.approx(l0, abs=1e-6)
    for name in g0:
        _same_grad(g2[name], g0[name], name)


def test_lora_and_untied_head_equal_with_and_without_chunks(tiny_model_path, tmp_path, tokenizer):
    """A peft-wrapped model (adapters on the attention and the head) and a model whose head is its own matrix."""
    from peft import LoraConfig, get_peft_model

    from tokenmill.recipes.tiny import build_tiny_model

    untied = build_tiny_model(tmp_path / "untied", hidden_size=32, num_layers=1, seed=1, tie_word_embeddings=False)
    samples = _samples(len(tokenizer), seed=3)
    batch = collate(samples, [1.0] * len(samples), pad_id=0)

    def build(kind):
        if kind == "untied":
            return _load(untied)
        torch.manual_seed(0)
        model = get_peft_model(_load(tiny_model_path), LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                                   init_lora_weights=False))
        return model

    for kind in ("lora", "untied"):
        runs = {}
        for chunk in (0, 3):
            model = build(kind)
            assert head_parts(model) is not None
            lp, _ = sequence_token_stats(model, batch.input_ids_B_T, lengths_B=batch.lengths_B, temperature=1.0,
                                         chunk_bytes=chunk * 4 * model.config.vocab_size)
            (lp * batch.weights_B_T).sum().backward()
            runs[chunk] = lp, _grads(model)
        (lp0, g0), (lp3, g3) = runs[0], runs[3]
        trained = batch.weights_B_T > 0
        torch.testing.assert_close(lp3[trained], lp0[trained], **TOL)
        assert any("lm_head" in n for n in g0), kind  # the head's adapter / own matrix gets a gradient
        for name in g0:
            _same_grad(g3[name], g0[name], f"{kind} {name}")
