"""`rewards: [{type: judge, ...}]`: an LLM judge behind an OpenAI-compatible endpoint (tokenmill.rewards.judge).

    rewards:
      - type: judge
        url: http://127.0.0.1:8000/v1   # any OpenAI-compatible server: tokenmill serve, vLLM, SGLang, a provider
        model: judge
        rubric: Is the final answer correct and justified?
        mode: rubric                     # or pairwise
        concurrency: 8
        timeout_s: 30
        retries: 2
        api_key_env: JUDGE_API_KEY
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from tokenmill.config.section import MAX_TOKENS, Section


class RewardJudgeConfig(Section):
    """An LLM judge behind an OpenAI-compatible endpoint scores the completions (tokenmill.rewards.judge):
    `rubric` grades each completion, `pairwise` gives each its win rate against the reference or its group."""

    type: Literal["judge"] = "judge"
    name: str = Field("judge", description="Name used in metrics.")
    url: str = Field(..., description="Base URL of the judge's OpenAI-compatible API, e.g. "
                     "http://127.0.0.1:8000/v1.")
    model: str = Field(..., description="The judge's model name at that endpoint.")
    mode: Literal["rubric", "pairwise"] = Field(
        "rubric", description="rubric: a score per completion, scaled to [0, 1]; pairwise: each completion's win "
        "rate (a tie counts 1/2) against its row's reference_column, or round-robin within its group.")
    rubric: str = Field("", description="The criteria, given to the judge as {rubric}.")
    prompt: str | None = Field(None, description="Template of the judge's request (null: the mode's own). Rubric "
                               "fields: {question} {completion} {rubric} {reference} {low} {high}; pairwise: "
                               "{question} {a} {b} {rubric}.")
    system: str | None = Field(None, description="A system message sent before the request.")
    reference_column: str | None = Field(None, description="Dataset column of the reference answer: rubric gives "
                                         "it as {reference}; pairwise compares each completion with it.")
    both_orders: bool = Field(True, description="Pairwise: ask each pair both ways round (cancels position bias).")
    score_range: tuple[float, float] = Field((0.0, 10.0), description="Rubric: the judge's scale, mapped to [0, 1].")
    score_pattern: str | None = Field(None, description="Rubric: a regex whose first group is the score (null: a "
                                      "<score>N</score> tag, a reply that is a number, or yes / no).")
    weight: float = Field(1.0, description="Weight in the total reward.")
    concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight at most.")
    timeout_s: float = Field(30.0, gt=0, description="Seconds one request may take.")
    retries: int = Field(2, ge=0, le=10, description="Retries of a request after a timeout, a connection error, "
                         "a 429 or a 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="Wait before the first retry; doubles each retry.")
    max_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="Longest judge reply.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="The judge's sampling temperature (0: greedy).")
    api_key_env: str | None = Field(None, description="Environment variable that holds the API key (null: none).")
    cache: Literal["memory", "disk", "off"] = Field(
        "memory", description="Answered requests are not asked again: memory; disk: also in "
        "<output_dir>/judge_cache/<name>.jsonl, read back on resume; off.")
    alarm_after: int = Field(3, ge=1, description="Batches in a row with no answer before the judge_down alarm.")

    @model_validator(mode="after")
    def _check(self) -> RewardJudgeConfig:
        # the prompt's fields are checked where the judge is built (rewards.build), by the judge itself
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.score_range[0] >= self.score_range[1]:
            raise ValueError(f"score_range must be [low, high] with low < high, got {list(self.score_range)}")
        if self.prompt is None and self.mode == "rubric" and not self.rubric.strip():
            raise ValueError("rubric: give the criteria the judge grades against (or a prompt of your own)")
        if self.score_pattern is not None:
            try:
                groups = re.compile(self.score_pattern).groups
            except re.error as exc:
                raise ValueError(f"score_pattern is not a regular expression: {exc}") from None
            if groups < 1:
                raise ValueError("score_pattern needs a group around the number, e.g. 'Score: (\\d+)'")
        return self

