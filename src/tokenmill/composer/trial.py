"""Try a run's result: the same prompt answered by the model the run left (its `final/` folder, or an SFT /
preference run's `model/`) and by the base model it started from, side by side, each token with its logprob.

Generation goes through tokenmill's own engine (`HFEngine`, the one the runs sample with), in the Composer's
process like the reward preview's; the two models stay loaded between questions (loading is the slow part)
and one question is answered at a time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tokenmill.composer.runs import RunError, RunManager

MAX_TRIAL_TOKENS = 512
_RESULT_FOLDERS = ("final", "model")  # RL runs export final/; sft / preference / reward_model runs model/


def result_folder(run_dir: Path) -> Path | None:
    """The HF model folder a run left, or None while it has none."""
    for name in _RESULT_FOLDERS:
        if (run_dir / name / "config.json").is_file():
            return run_dir / name
    return None


class Trial:
    """Answers prompts with a run's result and its base model; keeps the last two models loaded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[Any, Any]] = {}

    def _load(self, path: str) -> tuple[Any, Any]:
        from tokenmill.config.schema import ModelConfig
        from tokenmill.training.model import load_policy, resolve_device

        if path not in self._loaded:
            if len(self._loaded) >= 2:
                self._loaded.pop(next(iter(self._loaded)))
            model, tok = load_policy(ModelConfig(path=path), resolve_device("cpu"))
            self._loaded[path] = (model.eval(), tok)
        return self._loaded[path]

    def answer(self, path: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        """The greedy answer of the model at `path` to `prompt` (the chat template applied when the tokenizer
        has one): text, tokens with their logprobs, stop reason, seconds."""
        from tokenmill.engines.local.hf import HFEngine
        from tokenmill.types import SamplingParams

        with self._lock:
            start = time.perf_counter()
            model, tok = self._load(path)
            if getattr(tok, "chat_template", None):
                prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            params = SamplingParams(max_tokens=max_tokens, greedy=True, n=1)  # argmax; logprobs at temperature 1
            (done,) = HFEngine(model, tok, seed=0).generate([list(ids)], params)[0]
        return {"path": path, "text": tok.decode(list(done.token_ids), skip_special_tokens=True),
                "tokens": [{"text": tok.decode([t]), "logprob": float(lp)} for t, lp in zip(done.token_ids, done.logprobs,
                                                                                         strict=True)],
                "stop": done.stop_reason.value, "seconds": round(time.perf_counter() - start, 3)}

    def compare(self, runs: RunManager, run_id: str, base: str | None, prompt: str, max_tokens: int
                ) -> dict[str, Any]:
        """`{"result": answer, "base": answer}` for a run that has left a model; RunError 409 while it has
        none, 422 when its config names no base model."""
        folder = result_folder(runs.folder(run_id))
        if folder is None:
            raise RunError(409, f"run {run_id!r}: no model yet ({' or '.join(_RESULT_FOLDERS)}/ appears when "
                                "the run ends)")
        if not base:
            raise RunError(422, f"run {run_id!r}: its config names no model.path to compare with")
        max_tokens = max(1, min(max_tokens, MAX_TRIAL_TOKENS))
        return {"result": self.answer(str(folder), prompt, max_tokens), "base": self.answer(base, prompt, max_tokens)}
