"""Weight sync through a safetensors folder: write it atomically, then tell every server to load it.

The folder is written under a temporary name, fsynced and renamed, so a server never reads half a file; the
servers get `POST /update_weights_from_disk {"model_path", "policy_version", "weight_version"}` (our server and
SGLang's accept this shape: `python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port 30000`
serves the route by default). Only the tensors pushed are written (the trainable ones; a server loads only the
tensors present), and the previous version's folder is removed once every server has answered. The folder
must be readable by the servers (same machine or a shared filesystem); use `BroadcastSync` otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from tokenmill.sync.base import NamedTensors, check_engine_names
from tokenmill.sync.http import PushFailed, Servers


def write_folder(named_tensors: NamedTensors, folder: Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write `model.safetensors` into `folder` atomically (temporary sibling, fsync, rename); return `folder`."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in check_engine_names(named_tensors):
        t = t.detach()
        tensors[name] = (t.to(dtype) if dtype is not None else t).to("cpu").contiguous()
    if not tensors:
        raise ValueError("named_tensors: nothing to write")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        for path in (tmp / "model.safetensors", tmp):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


class FileSync:
    """`push` writes `<folder>/v<version>` and has every server in `urls` load it; raises `WeightSyncError`
    naming each server that refused (a refusal leaves that server on its old weights). `dtype` casts before
    writing (e.g. bf16 for a bf16 server: our server refuses a dtype that differs from its model's).
    `drop_failed`: a server that does not answer at all is dropped (logged) and the push counts when the
    others took it, so a run survives a dead engine; a server that refuses the weights always raises."""

    def __init__(self, urls: list[str], folder: str | os.PathLike, *, token: str | None = None,
                 timeout_s: float = 300.0, dtype: torch.dtype | None = None, drop_failed: bool = False) -> None:
        self.servers = Servers(urls, token=token, timeout_s=timeout_s)
        self.drop_failed = drop_failed
        self.folder = Path(folder).resolve()
        self.dtype = dtype
        self.last: Path | None = None

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        path = write_folder(named_tensors, self.folder / f"v{version:08d}", dtype=self.dtype)
        try:
            self.servers.post_all("/update_weights_from_disk", {
                "model_path": str(path), "policy_version": int(version), "weight_version": str(version),
            })
        except PushFailed as e:
            if not (self.drop_failed and e.unreachable and e.only_unreachable):
                raise
            self.servers.drop(e.unreachable)  # the others answered: they have the new weights
        finally:  # the servers have answered (or timed out): the older folder is no longer read
            if self.last is not None and self.last != path:
                shutil.rmtree(self.last, ignore_errors=True)
            self.last = path

    def close(self) -> None:
        self.servers.close()
