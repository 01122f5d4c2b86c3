"""`engines.remote.sync.for_servers`: the sync each `engine.sync` kind names, built for the servers and options given (nothing
is pushed: the choice and its settings are what is checked; tests/unit/sync/test_weight_sync.py pushes)."""

from __future__ import annotations

import pytest

from tokenmill.engines.remote.sync import for_servers
from tokenmill.engines.vllm import LORA_ADAPTER_NAME, VLLMBroadcastSync, VLLMLoRASync, VLLMReloadSync
from tokenmill.sync import BroadcastSync, FileSync
from tokenmill.sync.broadcast import PACKED_BUCKET_BYTES

ONE, TWO = ["http://127.0.0.1:9"], ["http://127.0.0.1:9", "http://127.0.0.1:10"]


def test_files_writes_to_the_folder_and_survives_a_server_only_when_there_are_two(tmp_path):
    one = for_servers("files", ONE, tmp_path / "weights", token="t", timeout_s=7)
    two = for_servers("files", TWO, tmp_path / "weights")
    try:
        assert type(one) is FileSync and one.folder == (tmp_path / "weights").resolve()
        assert one.servers.urls == ONE and not one.drop_failed
        assert two.servers.urls == TWO and two.drop_failed
    finally:
        one.close()
        two.close()


@pytest.fixture
def no_group(monkeypatch):
    """A broadcast sync forms its group with the servers when made: here no server answers, so it does not."""
    for cls in (BroadcastSync, VLLMBroadcastSync):
        monkeypatch.setattr(cls, "_open", lambda self: None)


@pytest.mark.parametrize("packed, bucket", [(False, 0), (True, PACKED_BUCKET_BYTES)])
def test_broadcast_packs_only_for_tokenmill_servers(packed, bucket, no_group):
    sync = for_servers("broadcast", TWO, packed=packed, timeout_s=7)
    try:
        assert type(sync) is BroadcastSync and sync.api == "sglang" and sync.bucket_bytes == bucket
        assert sync.servers.urls == TWO and sync.drop_failed and sync.timeout_s == 7
    finally:
        sync.close()


def test_vllm_kinds(tmp_path, no_group):
    from peft import LoraConfig

    reload = for_servers("vllm", ONE, tmp_path / "weights")
    lora_config = LoraConfig(r=4, target_modules=["q_proj"])
    adapters = for_servers("vllm", TWO, tmp_path / "vllm-lora", peft_config=lora_config)
    broadcast = for_servers("vllm_broadcast", TWO, timeout_s=7)
    try:
        assert type(reload) is VLLMReloadSync and reload.folder == (tmp_path / "weights").resolve()
        assert type(adapters) is VLLMLoRASync and adapters.peft_config is lora_config
        assert adapters.adapter_name == LORA_ADAPTER_NAME and adapters.drop_failed
        assert adapters.folder == (tmp_path / "vllm-lora").resolve()
        assert type(broadcast) is VLLMBroadcastSync and broadcast.api == "vllm" and broadcast.backend == "gloo"
    finally:
        for sync in (reload, adapters, broadcast):
            sync.close()


@pytest.mark.parametrize("kind, message", [("inprocess", "not a sync to servers"), ("ftp", "not a sync to servers"),
                                           ("files", "needs a folder")])
def test_a_kind_that_is_no_server_sync_is_refused(kind, message):
    with pytest.raises(ValueError, match=message):
        for_servers(kind, ONE)
