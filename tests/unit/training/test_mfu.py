"""FLOPs per token under tokenmill's and prime-rl's conventions (tokenmill.training.mfu), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.training.mfu import flops_per_token, matmul_params, mfu, peak_flops

QWEN3_0_6B = SimpleNamespace(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def test_matmul_parameters_of_qwen3_0_6b():
    per_layer = 1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072  # q, o; k, v; gate, up, down
    assert matmul_params(QWEN3_0_6B) == 28 * per_layer + 151936 * 1024 == 595_984_384


def test_the_two_conventions_differ_in_attention_only():
    dense = 6 * 595_984_384
    attention = 28 * 16_384 * 16 * 128
    assert flops_per_token(QWEN3_0_6B, 16_384) == dense + 6 * attention  # the causal half
    assert flops_per_token(QWEN3_0_6B, 16_384, "prime_rl") == dense + 12 * attention  # every key
    got = mfu(QWEN3_0_6B, 16_384, tokens_per_s=16_753, peak=989.4e12)
    assert got["tokenmill"] == pytest.approx(0.156, abs=5e-4)  # the H100 table's 15.6% at 16K
    assert got["prime_rl"] / got["tokenmill"] == pytest.approx((dense + 12 * attention) / (dense + 6 * attention))


def test_peaks_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA GH200 480GB") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("a CPU") is None
