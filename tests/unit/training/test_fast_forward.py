"""The trainer's fast forward (`logprobs.fast_forward`: the decode step's code on whole sequences) against the
decoder's own transformers forward: hidden states, packed logprobs and gradients equal within 1e-6 (fp32),
and the cases where it must step aside."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from tokenmill.training import logprobs
from tokenmill.training.batch import Batch
from tokenmill.training.logprobs import fast_forward, hidden_states, set_fast_forward
from tokenmill.training.packing import micro_packs, packed_token_stats


def _llama(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _qwen3():
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _group_batch(groups=3, size=4, prompt=5, seed=0) -> Batch:
    """`groups` prompts with `size` completions of 1..6 tokens each, right-padded, longest first."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        head = torch.randint(3, 60, (prompt,), generator=g).tolist()
        for _ in range(size):
            n = int(torch.randint(1, 7, (1,), generator=g))
            rows.append(head + torch.randint(3, 60, (n,), generator=g).tolist())
    rows.sort(key=len, reverse=True)
    width = len(rows[0])
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    n = len(rows)
    return Batch(ids, torch.tensor([len(r) for r in rows]), torch.ones(n, width), torch.zeros(n, width),
                 torch.zeros(n), prompt_lens_B=torch.full((n,), prompt))


def _packed_logprobs_and_grads(model, batch: Batch, fast: bool):
    set_fast_forward(model, fast)
    model.zero_grad(set_to_none=True)
    (sub, packed), = list(micro_packs(batch, 4096))
    logprob_B_T, ent_B_T = packed_token_stats(model, packed, tuple(sub.input_ids_B_T.shape), temperature=0.9,
                                              entropy=True, entropy_grad=True)
    (logprob_B_T.sum() + 0.1 * ent_B_T.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    set_fast_forward(model, True)
    return logprob_B_T.detach(), ent_B_T.detach(), grads


@pytest.mark.parametrize("make", [_llama, _qwen3, lambda: _llama(tie_word_embeddings=False)])
def test_packed_logprobs_and_gradients_equal_the_transformers_forward(make):
    model = make().train()
    assert fast_forward(model.get_decoder()) is not None
    batch = _group_batch()
    fast_lp, fast_ent, fast_grads = _packed_logprobs_and_grads(model, batch, True)
    plain_lp, plain_ent, plain_grads = _packed_logprobs_and_grads(model, batch, False)
    assert (fast_lp != 0).sum() > 20  # completion tokens got values
    assert torch.allclose(fast_lp, plain_lp, atol=1e-6, rtol=0), (fast_lp - plain_lp).abs().max()
    assert torch.allclose(fast_ent, plain_ent, atol=1e-6, rtol=0)
    assert fast_grads.keys() == plain_grads.keys() and len(fast_grads) == len(list(model.parameters()))
    for name, grad in fast_grads.items():
        assert torch.allclose(grad, plain_grads[name], atol=1e-6, rtol=1e-5), name


def test_padded_rows_without_a_mask_are_causal():
    """`sequence_token_stats`' right-padded rows: ids only, so the fast forward runs causal attention."""
    model = _llama().eval()
    decoder = model.get_decoder()
    ids = torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(2))
    fast = hidden_states(decoder, input_ids=ids)
    plain = decoder(input_ids=ids, use_cache=False).last_hidden_state
    assert torch.allclose(fast, plain, atol=1e-6, rtol=0)
    # a token's state depends on earlier tokens only
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 60
    again = hidden_states(decoder, input_ids=changed)
    assert torch.equal(again[:, :6], fast[:, :6]) and not torch.allclose(again[:, 6:], fast[:, 6:])


def test_steps_aside_where_it_would_not_be_the_same_forward():
    model = _llama()
    decoder = model.get_decoder()
    assert fast_forward(decoder) is not None
    assert fast_forward(decoder, {"input_ids": None, "segments": object()}) is None  # attention by segments
    assert fast_forward(decoder, {"input_ids": None, "attention_mask": torch.ones(2, 3)}) is None  # 2-D mask
    set_fast_forward(model, False)
    assert fast_forward(decoder) is None
    set_fast_forward(model, True)
    handle = decoder.layers[0].register_forward_hook(lambda *a: None)
    assert fast_forward(decoder) is None  # a hook added after the first call is still seen
    handle.remove()
    assert fast_forward(decoder) is not None
    model.gradient_checkpointing_enable()
    assert fast_forward(decoder) is None
    eager = _llama(attn_implementation="eager").get_decoder()
    assert fast_forward(eager) is None
    dropout = _llama(attention_dropout=0.1).get_decoder()
    assert fast_forward(dropout.train()) is None and fast_forward(dropout.eval()) is not None
    assert logprobs.decoder_blocker(torch.nn.Linear(2, 2), None) is not None


def test_training_config_turns_it_off(tmp_path, tiny_model_path):
    from tokenmill.config.schema import RLConfig
    from tokenmill.controller.trainer import build_trainer

    cfg = RLConfig.model_validate({"model": {"path": tiny_model_path}, "data": {"task": "addition"},
                                   "training": {"fast_forward": False},
                                   "tracking": {"output_dir": str(tmp_path)}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = build_trainer(cfg, model, torch.device("cpu"), None).backend
    assert fast_forward(backend.model.get_decoder()) is None
    assert fast_forward(AutoModelForCausalLM.from_pretrained(tiny_model_path).get_decoder()) is not None



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_on_gpu_the_fast_forward_is_as_close_to_fp64_as_transformers(autocast):
    """fp32 weights on a GPU, plain or under bf16 autocast (a GPU run's default): the fast forward's logprobs
    and gradients are no further from an fp64 CPU reference than the transformers forward's."""
    errors = _errors_against_fp64("cuda", autocast)
    (fast_lp, fast_grad), (plain_lp, plain_grad) = errors[True], errors[False]
    floor = 5e-2 if autocast else 1e-5
    assert fast_lp <= max(2 * plain_lp, floor), errors
    assert fast_grad <= max(2 * plain_grad, floor), errors


def _errors_against_fp64(device: str, autocast: bool) -> dict:
    """{fast: (largest logprob error, largest relative gradient error)} against an fp64 CPU run."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, batch = _qwen3(), _group_batch()
    double = Batch(*(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                     for t in (getattr(batch, f.name) for f in dataclasses.fields(batch))))
    ref_lp, _, ref_grads = _packed_logprobs_and_grads(model.double().train(), double, True)
    model, batch = model.float().to(device), batch.to(device)
    errors = {}
    for fast in (True, False):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            lp, _, grads = _packed_logprobs_and_grads(model, batch, fast)
        grad_err = max(float((g.double().cpu() - ref_grads[n]).norm() / ref_grads[n].norm()) for n, g in grads.items())
        errors[fast] = (float((lp.double().cpu() - ref_lp).abs().max()), grad_err)
    return errors
