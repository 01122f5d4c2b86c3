"""vLLM's `routed_experts` (a completions choice's MoE routing, `--enable-return-routed-experts`) is what
`RemoteEngine` reads: the string vLLM's own encoder makes decodes to the routes a `Completion` carries. vLLM 0.32
returns them only from its V2 model runner, which needs Triton, so no CPU server answers them (docs/vllm.md);
the encoding is checked here with vLLM's own function."""

from __future__ import annotations

import subprocess

import torch

from tokenmill.engines.local.routing import decode_routed_experts, encode_routed_experts
from tokenmill.engines.remote.client import _completion

ROUTES = [[[0, 7], [3, 1]], [[2, 5], [6, 4]], [[1, 0], [7, 2]]]  # [tokens read, layers, top_k]


def test_vllms_encoding_decodes_to_a_completions_routes(vllm_python):
    script = ("import numpy as np; from vllm.utils.serial_utils import numpy2base64; "
              f"print(numpy2base64(np.array({ROUTES}, dtype=np.uint8)))")
    done = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=300, check=True)
    text = done.stdout.strip().splitlines()[-1]
    choice = {"token_ids": [4, 9], "logprobs": {"token_logprobs": [-0.5, -1.0]}, "finish_reason": "length",
              "routed_experts": text}
    c = _completion(choice, prompt_len=2, routed=True)  # 2 prompt + 2 sampled tokens, the last one never read
    assert c.routes.dtype == torch.int16 and c.routes.tolist() == [
        [0, 7, 3, 1], [2, 5, 6, 4], [1, 0, 7, 2], [-1, -1, -1, -1]]
    assert torch.equal(decode_routed_experts(encode_routed_experts(c.routes, layers=2), 4), c.routes)
    assert encode_routed_experts(c.routes, layers=2) == text  # tokenmill serve answers vLLM's very bytes
