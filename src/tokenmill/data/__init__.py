"""Prompt datasets and their reading order."""

from tokenmill.data.prompts import PromptSource, load_rows

__all__ = ["PromptSource", "load_rows"]
