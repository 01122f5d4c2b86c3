"""`engine.sync: vllm` (no server needed): only for remote placements, and it builds the vLLM reload sync."""

from __future__ import annotations

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.types import ConfigError


@pytest.mark.parametrize("sync", ["vllm", "vllm_broadcast"])
@pytest.mark.parametrize("placement", ["process", "thread", "colocated"])
def test_vllm_sync_needs_remote_servers(placement, sync):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}},
                    {"engine.placement": placement, "engine.sync": sync})
    assert str(err.value).startswith("engine.sync"), str(err.value)


@pytest.mark.parametrize("override, field", [({"generation.top_k": 5}, "generation.top_k"),
                                             ({"generation.top_p": 0.9}, "generation.top_p")])
def test_vllm_sync_refuses_truncated_sampling(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}},
                    {"engine.placement": "remote", "engine.urls": ["http://127.0.0.1:9"], "engine.sync": "vllm",
                     **override})
    assert str(err.value).startswith(field) and "top_p 1.0" in str(err.value), str(err.value)


def test_vllm_sync_is_the_reload_sync(tmp_path):
    from tokenmill.engines.remote.sync import for_servers
    from tokenmill.engines.vllm import VLLMReloadSync

    cfg = load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}},
                      {"engine.placement": "remote", "engine.urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"],
                       "engine.sync": "vllm", "engine.timeout_s": 7})
    sync = for_servers(cfg.engine.weight_sync, list(cfg.engine.urls), tmp_path / "weights",
                       timeout_s=cfg.engine.timeout_s)
    try:
        assert isinstance(sync, VLLMReloadSync)
        assert sync.servers.urls == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
        assert sync.folder == (tmp_path / "weights").resolve() and sync.drop_failed  # two servers: survive one
    finally:
        sync.close()


def test_server_command_names_what_remote_engine_needs():
    from tokenmill.engines import vllm

    cmd = vllm.server_command("/venv/bin/python", "/m", port=8123)
    flags = dict(zip(cmd[3::2], cmd[4::2]))  # after: python -m MODULE
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--served-model-name"] == "tokenmill" and flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123" and flags["--dtype"] == "float32"
