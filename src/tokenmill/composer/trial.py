"""Try a run's result: the same prompt answered by a model the run left (its `final/` folder, an SFT /
preference run's `model/`, or one of its checkpoints) and by the base model it started from, side by side,
each token with its logprob; and export a checkpoint as a plain HF folder (LoRA adapters merged).

Answers come from tokenmill's own engine server: each model folder gets a `tokenmill serve` subprocess on a
free loopback port, guarded by a bearer token only the Composer knows (handed over in the environment, never
on a command line), and the Composer asks it over the OpenAI-compatible routes through the remote engine's
`EndpointPool` (`/v1/chat/completions` when the tokenizer has a chat template, `/v1/completions` with the
text otherwise; `temperature: 0`, greedy). At most `keep` servers stay up (least recently asked is stopped
first); all of them stop with the Composer (and die with it if it is killed: `preexec_die_with_parent`).

A checkpoint (`checkpoints/step_<n>/model.safetensors`, the training module's weights, adapters included) is
served from its export: the run's model is built from its config, the checkpoint loaded into it and written
by `checkpoint.export.export_atomic` to `exports/step_<n>/` in the run folder, the adapters merged (the
adapter alone in `adapter/` beside it), once; later asks reuse the folder.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tokenmill import serving
from tokenmill.composer.runs import RunError, RunManager

MAX_TRIAL_TOKENS = 512
KEEP_SERVERS = 2  # the result and its base: one question's pair stays up
_RESULT_FOLDERS = ("final", "model")  # RL runs export final/; sft / preference / reward_model runs model/
EXPORTS = "exports"


def result_folder(run_dir: Path) -> Path | None:
    """The HF model folder a run left, or None while it has none."""
    for name in _RESULT_FOLDERS:
        if (run_dir / name / "config.json").is_file():
            return run_dir / name
    return None


def has_chat_template(folder: str) -> bool:
    """Whether the tokenizer saved in `folder` has a chat template (read from its files, nothing loaded)."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


class EngineServers:
    """`tokenmill serve` subprocesses, one per model folder, at most `keep` alive (least recently used first
    out). Thread-safe; `close` stops them all."""

    def __init__(self, keep: int = KEEP_SERVERS, *, timeout_s: float = 180.0) -> None:
        self.keep, self.timeout_s = keep, timeout_s
        self.token = secrets.token_urlsafe(24)
        self._lock = threading.Lock()
        self._live: OrderedDict[str, tuple[subprocess.Popen, Any]] = OrderedDict()

    def pool(self, folder: str):
        """The `EndpointPool` of `folder`'s server, started when it is not up (the oldest stopped at `keep`)."""
        with self._lock:
            if folder in self._live and self._live[folder][0].poll() is None:
                self._live.move_to_end(folder)
                return self._live[folder][1]
            self._stop(folder)
            while len(self._live) >= self.keep:
                self._stop(next(iter(self._live)))
            self._live[folder] = self._start(folder)
            return self._live[folder][1]

    def _start(self, folder: str) -> tuple[subprocess.Popen, Any]:
        from tokenmill.engines.remote.pool import EndpointPool
        from tokenmill.sandbox.lifetime import parent_env, preexec_die_with_parent

        env = parent_env(dict(os.environ)) | {"TOKENMILL_SERVE_TOKEN": self.token}
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", folder, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec_die_with_parent())  # noqa: PLW1509 - prctl and getppid only
        try:
            port = serving.wait_for_port(proc, timeout_s=self.timeout_s)
        except (TimeoutError, ChildProcessError) as exc:
            proc.kill()
            raise RunError(502, f"`tokenmill serve {folder}` {exc}") from None
        return proc, EndpointPool([f"http://127.0.0.1:{port}"], token=self.token, timeout_s=self.timeout_s,
                                  retries=0)

    def _stop(self, folder: str) -> None:
        if folder not in self._live:
            return
        proc, pool = self._live.pop(folder)
        pool.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def alive(self) -> list[str]:
        """The folders served now, least recently asked first."""
        with self._lock:
            return [f for f, (proc, _) in self._live.items() if proc.poll() is None]

    def close(self) -> None:
        with self._lock:
            for folder in list(self._live):
                self._stop(folder)


class Trial:
    """Answers prompts with a run's models and its base model through `EngineServers`; exports checkpoints."""

    def __init__(self, keep: int = KEEP_SERVERS) -> None:
        self.servers = EngineServers(keep)
        self._lock = threading.Lock()  # one question (and one export) at a time

    def answer(self, path: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        """The greedy answer of the model at `path` to `prompt` (the chat template applied when the tokenizer
        has one): text, tokens with their logprobs, stop reason, seconds, the server that answered."""
        from tokenmill.engines.base import EngineUnavailable
        from tokenmill.engines.remote.pool import EngineRequestError

        start = time.perf_counter()
        pool = self.servers.pool(path)
        chat = has_chat_template(path)
        body: dict[str, Any] = {"model": Path(path).name, "max_tokens": max_tokens, "temperature": 0.0,
                                "logprobs": True if chat else 1}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        try:
            answer = pool.post("/v1/chat/completions" if chat else "/v1/completions", body)
        except (EngineRequestError, EngineUnavailable) as exc:
            raise RunError(502, f"`tokenmill serve {path}`: {exc}") from None
        choice = answer["choices"][0]
        if chat:
            pieces = [(e["token"], e["logprob"]) for e in choice["logprobs"]["content"]]
            text = choice["message"]["content"] or ""
        else:
            pieces = list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], strict=True))
            text = choice["text"]
        return {"path": path, "text": text, "tokens": [{"text": t, "logprob": float(lp)} for t, lp in pieces],
                "token_ids": choice.get("token_ids"), "stop": choice["finish_reason"], "route": "chat" if chat else
                "completions", "server": pool.endpoints[0].url, "seconds": round(time.perf_counter() - start, 3)}

    def compare(self, runs: RunManager, run_id: str, base: str | None, prompt: str, max_tokens: int,
                source: str = "final") -> dict[str, Any]:
        """`{"result": answer, "base": answer}`: `source` ("final" or a checkpoint's name) beside the base
        model. RunError 409 while the run has no such model, 422 when its config names no base model."""
        if not base:
            raise RunError(422, f"run {run_id!r}: its config names no model.path to compare with")
        max_tokens = max(1, min(max_tokens, MAX_TRIAL_TOKENS))
        with self._lock:
            folder = self._folder(runs, run_id, source)
            return {"result": self.answer(str(folder), prompt, max_tokens), "base": self.answer(base, prompt,
                                                                                                max_tokens)}

    def export(self, runs: RunManager, run_id: str, source: str) -> dict[str, Any]:
        """`source` as a plain HF folder: its path, and its LoRA adapter's path when the run trained one."""
        with self._lock:
            folder = self._folder(runs, run_id, source)
        adapter = folder / "adapter"
        return {"source": source, "path": str(folder.resolve()),
                "adapter": str(adapter.resolve()) if (adapter / "adapter_config.json").is_file() else None}

    def _folder(self, runs: RunManager, run_id: str, source: str) -> Path:
        run_dir = runs.folder(run_id)
        if source == "final":
            folder = result_folder(run_dir)
            if folder is None:
                raise RunError(409, f"run {run_id!r}: no model yet ({' or '.join(_RESULT_FOLDERS)}/ appears when "
                                    "the run ends)")
            return folder
        found = {p.name: p for p in _checkpoints(run_dir)}
        if source not in found:
            raise RunError(404, f"run {run_id!r}: no checkpoint {source!r} (it has: {', '.join(found) or 'none'})")
        out = run_dir / EXPORTS / source
        if not (out / "config.json").is_file():
            _export_checkpoint(run_dir, found[source], out)
        return out


def _checkpoints(run_dir: Path) -> list[Path]:
    from tokenmill.checkpoint import list_checkpoints

    return list_checkpoints(run_dir / "checkpoints")


def sources(run_dir: Path) -> list[dict[str, Any]]:
    """What a run can be tried or exported from: its final model (once there) and each complete checkpoint."""
    out = [{"name": "final", "ready": result_folder(run_dir) is not None}]
    for path in _checkpoints(run_dir):
        out.append({"name": path.name, "ready": True, "exported": (run_dir / EXPORTS / path.name / "config.json").is_file()})
    return out


def _export_checkpoint(run_dir: Path, checkpoint: Path, out: Path) -> None:
    """The run's model built from its config (LoRA adapters included), `checkpoint`'s weights loaded into it,
    and written to `out` by `export_atomic` (adapters merged)."""
    from tokenmill.checkpoint import load_checkpoint
    from tokenmill.checkpoint.export import export_atomic
    from tokenmill.composer.compare import run_config
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.types import ConfigError

    model_cfg = run_config(run_dir).get("model")
    if not isinstance(model_cfg, dict) or not model_cfg.get("path"):
        raise RunError(422, f"{run_dir.name}: its config names no model.path to build the checkpoint's model from")
    try:
        model, tok = load_policy(ModelConfig.model_validate(model_cfg), resolve_device("cpu"))
        load_checkpoint(checkpoint, model)
    except (ConfigError, ValueError, RuntimeError, OSError) as exc:
        raise RunError(422, f"checkpoint {checkpoint.name}: cannot load it into the run's model: {exc}"[:2000]) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    export_atomic(model.eval(), tok, out)
