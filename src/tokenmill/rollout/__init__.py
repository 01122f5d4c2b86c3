"""The Generator: engine x rewards -> groups of samples."""

from tokenmill.rollout.generator import Generator, encode_prompt

__all__ = ["Generator", "encode_prompt"]
