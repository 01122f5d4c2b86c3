"""The receiving end of `engine.sync: vllm_broadcast`: code that runs inside vLLM's worker processes, not in
tokenmill's.

vLLM mixes this class into its worker class when the server is started with `--worker-extension-cls
tokenmill_vllm_worker.TokenmillWeightReceiver` (`tokenmill.engines.vllm.start_server` copies this file into a
folder of its own under that module name and puts the folder on the server's `PYTHONPATH`); its methods are then
called by `POST /collective_rpc {"method", "kwargs"}` (dev mode). It imports nothing from tokenmill (the vLLM
venv has neither tokenmill nor tokenmill's dependencies); from vLLM only what `_fix_cpu_lora_prompt_logprobs`
patches.

The weight group is torch.distributed's gloo backend built on a `TCPStore` the trainer hosts (rank 0), with the
store keys laid out as `tokenmill.sync.group.open_group` lays them out under the group name `GROUP`, so
the trainer's `BroadcastSync` group and this one meet. Each push receives every tensor first and only then
reloads the model (vLLM's own in-place reload, the one its `reload_weights` route runs from disk): a broadcast
that fails part-way leaves the server on its old weights. (vLLM's built-in weight-transfer engines start the
reload before the first tensor arrives, and a failure then leaves the model on the meta device.)
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

GROUP = "vllm_weight_transfer"  # = tokenmill.sync.group.VLLM_GROUP (the trainer's side of the store layout)


def _fix_cpu_lora_prompt_logprobs() -> None:
    """vLLM 0.32's CPU LoRA wrapper computes LoRA logits with one adapter index per *sampled* request
    (`sampler_indices`), also for `prompt_logprobs`, whose logits have one row per prompt position: with more
    than one request in the batch the shapes disagree and the engine dies (`einsum(): subscript b has size 17
    for operand 1 which does not broadcast with previously seen size 31`, then `EngineDeadError`), so any
    scoring request (tokenmill's weight-sync probe, a distillation teacher) kills a server started with
    `--enable-lora`. (The GPU wrapper maps rows by `x.size(0)` and is not affected.) When every request of the
    batch uses the same adapter (or none), that index is the right one for every row; this patch uses it. A
    batch mixing adapters still fails as before."""
    try:
        from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:  # not vLLM's CPU build: nothing to fix
        return
    original = PunicaWrapperCPU.add_lora_logits
    if getattr(original, "tokenmill_fixed", False):
        return

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        indices = self.sampler_indices
        rows = x.reshape(-1, x.shape[-1]).size(0)
        one = torch.unique(indices)
        if indices.numel() in (1, rows) or one.numel() != 1:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
        y2, x2 = y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
        expanded = one.expand(rows).contiguous()
        buf = torch.zeros((rows, lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
        bgmv_shrink(x2, lora_a_stacked, buf, expanded, scale)
        bgmv_expand(buf, lora_b_stacked, y2, expanded, add_inputs=True)

    add_lora_logits.tokenmill_fixed = True
    PunicaWrapperCPU.add_lora_logits = add_lora_logits


_fix_cpu_lora_prompt_logprobs()  # this module is imported in each vLLM worker before it builds its model


class TokenmillWeightReceiver:
    """Worker methods for `/collective_rpc`; every name starts with `tokenmill_` (vLLM refuses an extension whose
    names collide with its worker's)."""

    def tokenmill_receiver_ready(self) -> dict[str, Any]:
        """Answers when the extension is loaded (the trainer checks before it opens a group)."""
        return {"rank": int(self.rank), "joined": getattr(self, "_tokenmill_group", None) is not None}

    def tokenmill_join_weight_group(self, master_address: str, master_port: int, rank_offset: int,
                                    world_size: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Join the trainer's gloo group as rank `rank_offset` + this worker's rank; blocks until every rank
        has joined or `timeout_s` passes."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self._tokenmill_group = None
        timeout = datetime.timedelta(seconds=float(timeout_s))
        rank = int(rank_offset) + int(self.rank)
        store = TCPStore(str(master_address), int(master_port), int(world_size), False, timeout=timeout)
        prefixed = PrefixStore("cpu/", PrefixStore(f"{GROUP}/", PrefixStore(GROUP, store)))
        self._tokenmill_group = ProcessGroupGloo(prefixed, rank, int(world_size), timeout)
        self._tokenmill_store, self._tokenmill_timeout = store, timeout
        return {"rank": rank}

    def tokenmill_receive_weights(self, names: list[str], dtype_names: list[str],
                                  shapes: list[list[int]]) -> dict[str, Any]:
        """Receive the tensors the trainer broadcasts (in this order, with these dtypes and shapes), then reload
        them into the model in place. A failed receive drops the group (the trainer opens a new one)."""
        from torch.distributed import BroadcastOptions

        group = getattr(self, "_tokenmill_group", None)
        if group is None:
            raise RuntimeError("no weight group: call tokenmill_join_weight_group first")
        received = []
        try:
            for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
                tensor = torch.empty([int(s) for s in shape], dtype=getattr(torch, dtype_name.removeprefix("torch.")))
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self._tokenmill_timeout
                group.broadcast([tensor], opts).wait()
                received.append((name, tensor))
        except BaseException:
            self._tokenmill_group = None
            raise
        self.reload_weights(weights_iterator=iter(received))  # vLLM's in-place reload (repacks CPU kernels)
        return {"tensors": len(received)}

    def tokenmill_leave_weight_group(self) -> dict[str, Any]:
        self._tokenmill_group = None
        self._tokenmill_store = None
        return {"left": True}
