"""Test helpers: the tiny local model and tokenizer (built by `tokenmill.recipes.tiny`, which the quickstart
also uses) and a teacher-forced logprob reference (`tokenmill.testing.reference`).

Production code never imports this package: the built-in tasks live in `tokenmill.data.tasks` and the
quickstart recipes in `tokenmill.recipes`.
"""

from tokenmill.recipes.tiny import build_tiny_model, build_tiny_moe_model, build_tokenizer

__all__ = ["build_tiny_model", "build_tiny_moe_model", "build_tokenizer"]
