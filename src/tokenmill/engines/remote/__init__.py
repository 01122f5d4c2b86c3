"""Engines in another process: `client.RemoteEngine` samples from OpenAI-compatible servers (`tokenmill
serve`, vLLM), spread over them by `pool.EndpointPool`."""

from tokenmill.engines.remote.client import RemoteEngine

__all__ = ["RemoteEngine"]
