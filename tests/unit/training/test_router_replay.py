"""Router replay: the trainer routes each token to the recorded experts (hand-checked on one layer), the
engine/trainer mismatch of a bf16 engine against an fp32 trainer drops with r3, and r2 replays the trainer's
own pre-update routing through every pass of the update."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tokenmill.config import AlgorithmConfig, RLConfig, load_config
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.routing import moe_routers
from tokenmill.health.mismatch import mismatch_stats
from tokenmill.training import LocalBackend, collate
from tokenmill.training.router_replay import replaying, trainer_routes, with_trainer_routes
from tokenmill.training.update import policy_update
from tokenmill.types import ConfigError, Sample, SamplingParams, StopReason


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=64, num_layers=2, num_experts=8,
                                top_k=2, expert_size=64)


@pytest.fixture
def moe(moe_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32), AutoTokenizer.from_pretrained(moe_path)


def _layer0_io(model):
    """Hook the first router: its input hidden states and its (replayed) output, per call."""
    seen = []
    handle = moe_routers(model)[0].register_forward_hook(lambda m, i, o: seen.append((i[0].detach(), o)))
    return seen, handle


def test_replay_routes_to_the_recorded_experts_hand_checked_on_layer_0(moe):
    model, _ = moe
    ids_B_T = torch.tensor([[7, 12, 30, 41, 9, 17]])
    with torch.no_grad():
        own_B_T_R = trainer_routes(model, collate([_sample(ids_B_T[0].tolist())], [1.0], 0), 8192)
        plain = model(input_ids=ids_B_T).logits
    # force the two *least* likely experts of each token in each layer (never what the router picks)
    router0 = moe_routers(model)[0]
    forced_B_T_R = own_B_T_R.clone()
    for layer in range(2):
        forced_B_T_R[0, :, 2 * layer: 2 * layer + 2] = torch.tensor([[(e + 3) % 8, (e + 5) % 8]
                                                                    for e in own_B_T_R[0, :, 2 * layer].tolist()])
    forced_B_T_R[0, 5] = -1  # the last token: not recorded, routed by the trainer itself
    with torch.no_grad(), replaying(model, forced_B_T_R):
        seen, handle = _layer0_io(model)  # after the replay's hook: it sees the replayed output
        replayed = model(input_ids=ids_B_T).logits
        handle.remove()
    hidden_N_H, (_, weights_N_K, index_N_K) = seen[0]
    # by hand: probabilities softmax(h W^T), the forced experts', renormalised (Qwen3-MoE's norm_topk_prob)
    probs_N_E = torch.softmax(hidden_N_H @ router0.weight.detach().T, dim=-1)
    expected_index = forced_B_T_R[0, :, :2].clone()
    expected_index[5] = own_B_T_R[0, 5, :2]
    assert index_N_K.tolist() == expected_index.tolist()
    picked = probs_N_E.gather(1, expected_index)
    torch.testing.assert_close(weights_N_K, picked / picked.sum(-1, keepdim=True))
    assert not torch.allclose(replayed[0, :5], plain[0, :5], atol=1e-3)
    # replaying the model's own choices changes nothing, to the bit
    with torch.no_grad(), replaying(model, own_B_T_R):
        assert torch.equal(model(input_ids=ids_B_T).logits, plain)


def test_replay_keeps_the_gate_differentiable(moe):
    model, _ = moe
    ids_B_T = torch.tensor([[7, 12, 30, 41]])
    routes_B_T_R = torch.tensor([[[0, 1, 2, 3]] * 4])
    with replaying(model, routes_B_T_R):
        model(input_ids=ids_B_T).logits.logsumexp(-1).sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def _sample(tokens: list[int], prompt_len: int = 2, logprobs=None, routes=(), advantage: float = 1.0) -> Sample:
    n = len(tokens) - prompt_len
    return Sample(tokens=tuple(tokens), loss_mask=(0,) * prompt_len + (1,) * n,
                  logprobs=tuple(logprobs) if logprobs else (0.0,) * len(tokens), prompt_len=prompt_len, prompt="p",
                  completion="c", stop_reason=StopReason.STOP, routes=routes, advantage=advantage)


def _rollout(model, tok, autocast):
    """Samples from an engine on a copy of `model` (bf16 autocast or not) that records its routing."""
    engine = HFEngine(copy.deepcopy(model), tok, seed=1, autocast_dtype=autocast)
    engine.record_routing(True)
    prompts = [[5 + i, 6 + i, 7, 8 + i, 9] for i in range(6)]
    out = engine.generate(prompts, SamplingParams(n=4, max_tokens=20, temperature=1.0))
    return [_sample(p + list(c.token_ids), len(p), (0.0,) * len(p) + c.logprobs, c.routes)
            for p, group in zip(prompts, out, strict=True) for c in group]


def test_r3_removes_the_routing_part_of_a_bf16_engine_mismatch(moe):
    model, tok = moe
    samples = _rollout(model, tok, torch.bfloat16)  # engine: bf16 autocast; trainer: fp32
    batch = collate(samples, [1.0] * len(samples), tok.pad_token_id)
    stats = {}
    for mode in ("off", "r3"):
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, router_replay=mode)
        stats[mode] = mismatch_stats(batch.old_logprobs_B_T, backend.forward(batch), batch.weights_B_T > 0)
    # some tokens went to other experts in bf16: their logprobs are far apart; replayed, only bf16 rounding is left
    assert stats["off"]["mismatch/max_abs"] > 0.1 and stats["r3"]["mismatch/max_abs"] < 0.05
    assert stats["r3"]["mismatch/kl"] < stats["off"]["mismatch/kl"] / 10


def test_r2_replays_the_pre_update_routing_in_every_pass(moe):
    model, _ = moe
    samples = [_sample([5, 6, 7, 8, 9, 10, 11], advantage=1.0), _sample([5, 6, 12, 13, 14], advantage=-1.0)]
    before = with_trainer_routes(samples, LocalBackend(model, learning_rate=1e-3, total_steps=1), 0)
    assert all(len(s.routes) == len(s.tokens) and all(e >= 0 for r in s.routes for e in r) for s in before)
    backend = LocalBackend(model, learning_rate=0.5, total_steps=3, router_replay="r2")
    passes = []
    run = backend.forward_backward
    backend.forward_backward = lambda batch, *a, **k: (passes.append(batch.routes_B_T_R), run(batch, *a, **k))[1]
    policy_update(samples, backend, AlgorithmConfig(ppo_epochs=3), pad_id=0, max_tokens=8, rng=random.Random(0))
    expected = collate(before, [1.0, 1.0], 0).routes_B_T_R
    assert len(passes) == 3 and all(torch.equal(p, expected) for p in passes)
    # the weights moved enough that the trainer would now route some tokens elsewhere
    with torch.no_grad():
        after = trainer_routes(model, collate(samples, [1.0, 1.0], 0), 8192)
    assert not torch.equal(after, expected)


@pytest.mark.parametrize("section, needle, r2_ok", [
    ({"engine": {"placement": "worker"}}, "the worker placement does not record it", True),
    ({"cluster": {"backend": "ray", "engine_replicas": 2}, "engine": {"placement": "process"}}, "engine replicas",
     True),
    ({"training": {"backend": "fsdp2"}}, "runs on training.backend local", False),
])
def test_router_replay_config_is_checked_by_field(section, needle, r2_ok):
    def tree(mode):
        out = {"model": {"path": "m"}, "data": {"task": "addition"}, "training": {"router_replay": mode}}
        for key, value in section.items():
            out[key] = {**out.get(key, {}), **value}
        return out

    with pytest.raises(ConfigError, match=f"training.router_replay: .*{needle}"):
        load_config(RLConfig, tree("r3"))
    if r2_ok:  # r2 records in the trainer: any engine, any rollout
        assert load_config(RLConfig, tree("r2")).training.router_replay == "r2"


@pytest.mark.parametrize("section", [{"env": {"name": "guess_number"}}, {"env": {"name": "guess_number",
                                                                                  "stepwise": True}},
                                     {"engine": {"placement": "remote", "urls": ["http://127.0.0.1:9"]}},
                                     {"engine": {"placement": "process"}}])
def test_r3_is_taken_where_the_engine_records(section):
    tree = {"model": {"path": "m"}, "data": {"task": "addition"}, "training": {"router_replay": "r3"}, **section}
    assert load_config(RLConfig, tree).training.router_replay == "r3"
