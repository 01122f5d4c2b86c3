"""`for_servers`: the weight sync of a kind (`engine.sync`) to engine servers at some URLs.

    >>> sync = for_servers("files", ["http://127.0.0.1:8000"], Path("scratch/weights"))   # doctest: +SKIP
    >>> sync.push(backend.weights(), version=1)                                            # doctest: +SKIP

The in-process kind is not here: an engine in the trainer's process (colocated, thread, worker) takes the
weights through its own `update_weights` (`InProcessSync` when a sync object is wanted).
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.sync.base import WeightSync
from tokenmill.sync.broadcast import PACKED_BUCKET_BYTES, BroadcastSync
from tokenmill.sync.files import FileSync

SERVER_KINDS = ("files", "broadcast", "vllm", "vllm_broadcast")


def for_servers(kind: str, urls: list[str], folder: str | os.PathLike | None = None, *, token: str | None = None,
                timeout_s: float = 300.0, packed: bool = False, peft_config: Any = None) -> WeightSync:
    """The push of `kind` to the servers at `urls`:

    - files: safetensors in `folder`, then each server reloads them (tokenmill serve, SGLang);
    - broadcast: a torch.distributed group with the servers; `packed`: tokenmill servers, which take
      several tensors per message;
    - vllm: vLLM's reload routes over safetensors in `folder`; with `peft_config`, the LoRA adapters
      alone, written to `folder` (which must outlive the run: vLLM re-reads an adapter from its path);
    - vllm_broadcast: a gloo broadcast into tokenmill's vLLM worker extension.

    With several servers, one that stops answering is dropped (the pool sends its requests elsewhere) and
    the run goes on; a refusal, or the last server gone, still stops it."""
    survive = len(urls) > 1
    if kind in ("files", "vllm") and folder is None:
        raise ValueError(f"weight sync {kind!r}: needs a folder to write the weights to")
    if kind == "files":
        return FileSync(urls, folder, token=token, timeout_s=timeout_s, drop_failed=survive)
    if kind == "broadcast":
        return BroadcastSync(urls, token=token, timeout_s=timeout_s, drop_failed=survive,
                             bucket_bytes=PACKED_BUCKET_BYTES if packed else 0)
    if kind == "vllm" and peft_config is not None:
        from tokenmill.engines.vllm.sync import VLLMLoRASync

        return VLLMLoRASync(urls, folder, peft_config, token=token, timeout_s=timeout_s, drop_failed=survive)
    if kind == "vllm":
        from tokenmill.engines.vllm.sync import VLLMReloadSync

        return VLLMReloadSync(urls, folder, token=token, timeout_s=timeout_s, drop_failed=survive)
    if kind == "vllm_broadcast":
        from tokenmill.engines.vllm.sync import VLLMBroadcastSync

        return VLLMBroadcastSync(urls, token=token, timeout_s=timeout_s, drop_failed=survive)
    raise ValueError(f"weight sync {kind!r}: not a sync to servers (one of {', '.join(SERVER_KINDS)}; in-process "
                     f"engines take weights through their own update_weights)")
