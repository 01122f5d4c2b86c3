"""`ProxyService`: the proxy run's endpoint over a copy of the policy, its weight updates, and the agent program
it starts with the endpoint's URL and token filled in."""

from __future__ import annotations

import socket
import sys
import time

import httpx
import pytest
import torch

from tokenmill.config.schema import ProxyConfig
from tokenmill.rollout.proxy_service import ProxyService
from tokenmill.types import TokenmillError


def _version(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["policy_version"]


def test_serves_a_copy_at_the_version_given_and_takes_updates(tiny_model, tokenizer, tmp_path):
    torch.set_num_threads(1)
    argv_file = tmp_path / "argv"
    command = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))",
               str(argv_file), "{url}", "{token}"]
    service = ProxyService(tiny_model, tokenizer, ProxyConfig(port=0, agent_command=command), seed=0, max_tokens=4,
                           version=3)
    try:
        assert service.url.startswith("http://127.0.0.1:") and _version(service.url) == 3
        first = next(iter(tiny_model.parameters()))
        served = next(iter(service.engine.model.parameters()))
        assert served is not first and torch.equal(served, first)  # a copy: the trainer's module stays its own
        service.update_weights([(name, p + 1.0) for name, p in tiny_model.named_parameters()], version=4)
        assert _version(service.url) == 4
        assert torch.equal(next(iter(service.engine.model.parameters())), first + 1.0)
        agent = service.start_agent()
        assert agent is service.agent and agent.wait(timeout=60) == 0
        assert argv_file.read_text() == f"{service.url} none"
    finally:
        service.close()


def test_an_agent_that_cannot_start_is_named_and_the_endpoint_stops(tiny_model, tokenizer):
    service = ProxyService(tiny_model, tokenizer, ProxyConfig(port=0, agent_command=["/no/such/agent"]), seed=0,
                           max_tokens=4)
    url = service.url
    with pytest.raises(TokenmillError, match=r"proxy.agent_command: cannot start '/no/such/agent'"):
        service.start_agent()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_no_agent_command_starts_nothing(tiny_model, tokenizer):
    service = ProxyService(tiny_model, tokenizer, ProxyConfig(port=0), seed=0, max_tokens=4)
    try:
        assert service.start_agent() is None and service.agent is None
    finally:
        service.close()


def test_the_endpoint_closes_silent_clients_after_proxy_read_timeout_s(tiny_model, tokenizer):
    cfg = ProxyConfig(port=0, read_timeout_s=0.3, max_connections=5)
    service = ProxyService(tiny_model, tokenizer, cfg, seed=0, max_tokens=4)
    try:
        assert service.server.slots.cap == 5 and service.server.slots.read_timeout_s == 0.3
        silent = socket.create_connection(("127.0.0.1", service.server.port), timeout=5)
        start = time.monotonic()
        assert silent.recv(1) == b"" and time.monotonic() - start < 1.0  # closed by the server, not by us
        silent.close()
        assert service.server.slots.timed_out == 1
    finally:
        service.close()
