"""A reward model: a sequence-classification folder with one output, scoring prompt + completion."""

from __future__ import annotations

from typing import Any

from tokenmill.types import RewardResult


class ModelReward:
    """Scores `prompt + completion` (chat prompts through the tokenizer's template) with a scalar head."""

    def __init__(
        self, path: str, *, name: str | None = None, weight: float = 1.0, batch_size: int = 32, device: str = "cpu"
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = name or path.rstrip("/").split("/")[-1]
        self.weight = weight
        self.batch_size = batch_size
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path} has {self.model.config.num_labels} labels, expected 1")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"

    def _text(self, prompt: Any, completion: str) -> str:
        if isinstance(prompt, list):
            messages = prompt + [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + completion

    def __call__(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        state: Any = None,
    ) -> list[RewardResult]:
        import torch

        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[RewardResult] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True)
                logits = self.model(**enc.to(self.device)).logits[:, 0].float()
                scores.extend(RewardResult(float(v)) for v in logits.tolist())
        return scores

    def close(self) -> None:
        pass
