"""`TrainerService`: one base model, many LoRA adapters, each trained by its own client.

Everything here takes and returns plain data (lists, dicts, numbers), so the in-process client calls it
directly and the HTTP server (`client/server.py`) only maps routes onto it. Every operation holds the service's
lock: requests to one model run one at a time, each with its own adapter switched on.

A training client owns an adapter, a `LocalBackend` (its own AdamW state over that adapter's parameters) and an
`HFEngine` on the shared module (its own sampling RNG). A sampling client samples from a snapshot adapter.
So two clients never share a parameter, a gradient, an optimiser moment or a random stream: each one's run is
what it would be alone on the server.
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.algorithms.losses import LOSSES, ppo_clip_loss, sft_loss
from tokenmill.engines.local.hf import HFEngine
from tokenmill.rollout.generator import encode_prompt
from tokenmill.training.batch import Batch, collate
from tokenmill.training.local import LocalBackend
from tokenmill.training.spec import TrainerSpec, policy_backend
from tokenmill.types import Sample, SamplingParams, StopReason, TokenmillError

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_SAMPLES = 4096  # completions one sample request may ask for (prompts x n)


class RequestError(TokenmillError):
    """A request the service refuses; `status` is its HTTP status (400, 404, 409), `param` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def importance_sampling_loss(logprobs_B_T, old_logprobs_B_T, advantages, weights_B_T, **_):
    """REINFORCE with an importance ratio: loss = -sum_t w_t * exp(logp_t - logp_old_t) * A_t."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs_B_T - old_logprobs_B_T)
    loss = -(ratio * adv * weights_B_T).sum()
    return loss, {"policy_loss": loss.detach(), "ratio_mean": (ratio.detach() * weights_B_T).sum()}


NAMED_LOSSES: dict[str, Callable[..., Any]] = {
    "cross_entropy": sft_loss, "importance_sampling": importance_sampling_loss, "ppo": ppo_clip_loss,
    **{name: fn for name, fn in LOSSES.items() if name != "sft"},
}


@dataclass
class Trainee:
    adapter: str
    backend: LocalBackend
    engine: HFEngine
    config: dict[str, Any]


@dataclass
class Sampler:
    adapter: str
    engine: HFEngine
    generation: int = 0  # a training client's snapshot sampler is refreshed in place: older ids are refused


def datum_sample(d: Any, i: int) -> Sample:
    """One datum (`tokens`, `weights`, and for the policy losses `logprobs` and `advantages`; per-token lists
    aligned with the tokens, `advantages` also as one number) as a `Sample`."""
    if not isinstance(d, dict) or not isinstance(d.get("tokens"), list) or len(d["tokens"]) < 2:
        raise RequestError(f"data.{i}.tokens: a list of at least 2 token ids", f"data.{i}.tokens")
    n = len(d["tokens"])
    weights = d.get("weights", [0.0] + [1.0] * (n - 1))
    logprobs = d.get("logprobs", [0.0] * n)
    adv = d.get("advantages", 0.0)
    for name, value in (("weights", weights), ("logprobs", logprobs)) + ((("advantages", adv),) if isinstance(adv, list) else ()):
        if not isinstance(value, list) or len(value) != n:
            raise RequestError(f"data.{i}.{name}: one number per token ({n}), got "
                               f"{len(value) if isinstance(value, list) else type(value).__name__}", f"data.{i}.{name}")
        finite(value, f"data.{i}.{name}")
    per_token = isinstance(adv, list)
    if not per_token:
        finite([adv], f"data.{i}.advantages")
    zeros = (0.0,) * n if per_token else ()
    return Sample(tokens=tuple(d["tokens"]), loss_mask=tuple(weights), logprobs=tuple(logprobs), prompt_len=0,
                  prompt=None, completion="", stop_reason=StopReason.STOP, advantage=0.0 if per_token else float(adv),
                  token_advantages=tuple(adv) if per_token else (), returns=zeros, values=zeros)


def finite(values: list, param: str) -> None:
    """Refuse a list holding anything but finite numbers: a NaN or inf input makes a NaN update."""
    for value in values:
        if not is_number(value) or not math.isfinite(value):
            raise RequestError(f"{param}: finite numbers only, got {value!r} (a NaN or inf input would ruin the "
                               "adapter's weights)", param)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_seed(seed: Any) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise RequestError("seed: a whole number from 0 to 2**63 - 1", "seed")


class TrainerService:
    """The shared base model and its clients. `root` holds saved states and sampler weights."""

    def __init__(self, base_model: str, root: str | Path, *, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_model, self.root = base_model, Path(root).resolve()  # made by the first save
        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        self.model: Any = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).to(device)
        self.lock = threading.Lock()
        self.trainees: dict[str, Trainee] = {}
        self.samplers: dict[str, Sampler] = {}
        self.count = 0

    # ----------------------------------------------------------------------------------- adapters
    def _add_adapter(self, name: str, rank: int, alpha: float, seed: int, target_modules: Any) -> None:
        from peft import LoraConfig, PeftModel, get_peft_model

        cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules)
        try:
            with torch.random.fork_rng(devices=[]):  # the initialisation depends on the seed alone
                torch.manual_seed(seed)
                if isinstance(self.model, PeftModel):
                    self.model.add_adapter(name, cfg)
                else:
                    self.model = get_peft_model(self.model, cfg, adapter_name=name)
        except (ValueError, TypeError, re.error) as exc:  # a module name that matches nothing, a bad pattern
            raise RequestError(f"target_modules: {exc}", "target_modules") from None
        self.model.set_adapter(name)

    def _use(self, adapter: str) -> None:
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)

    def _trainee(self, cid: str) -> Trainee:
        if not isinstance(cid, str) or cid not in self.trainees:
            raise RequestError(f"no training client {cid!r}", "client_id", 404)
        self._use(self.trainees[cid].adapter)
        return self.trainees[cid]

    def create_training_client(self, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                               target_modules: Any = "all-linear") -> dict[str, Any]:
        if not isinstance(rank, int) or not 1 <= rank <= 1024:
            raise RequestError("rank: a whole number from 1 to 1024", "rank")
        if not is_number(alpha) or not 0 < alpha < math.inf:
            raise RequestError("alpha: a finite number > 0", "alpha")
        check_seed(seed)
        if not (isinstance(target_modules, str) and target_modules or isinstance(target_modules, list)
                and target_modules and all(isinstance(m, str) and m for m in target_modules)):
            raise RequestError("target_modules: 'all-linear', a module name or a list of module names",
                               "target_modules")
        with self.lock:
            self.count += 1
            cid = f"t{self.count}"
            self._add_adapter(cid, rank, alpha, seed, target_modules)
            spec = TrainerSpec(learning_rate=1e-4, total_steps=1, share_prompts=False, max_grad_norm=float("inf"))
            backend = policy_backend(spec, self.model)
            engine = HFEngine(self.model, self.tokenizer, seed=seed)
            self.trainees[cid] = Trainee(cid, backend, engine,
                                         {"rank": rank, "alpha": alpha, "target_modules": target_modules})
            return {"client_id": cid, "trainable_parameters": sum(p.numel() for p in backend.params)}

    # ----------------------------------------------------------------------------------- training
    def _batch(self, data: Any) -> Batch:
        if not isinstance(data, list) or not data:
            raise RequestError("data: a non-empty list of datums", "data")
        samples = [datum_sample(d, i) for i, d in enumerate(data)]
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, s in enumerate(samples):
            if not all(isinstance(t, int) and 0 <= t < vocab for t in s.tokens):
                raise RequestError(f"data.{i}.tokens: token ids must be in [0, {vocab})", f"data.{i}.tokens")
        return collate(samples, [1.0] * len(samples), self._pad_id())

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def forward_backward(self, cid: str, data: Any, loss_fn: str | Callable = "cross_entropy",
                         loss_fn_config: dict | None = None) -> dict[str, Any]:
        """Accumulate the gradients of the loss (a name, or in-process a `BatchLoss` callable) over `data`;
        return its summed metrics (`loss`, and the loss's own)."""
        if callable(loss_fn):
            fn = loss_fn
        elif isinstance(loss_fn, str) and loss_fn in NAMED_LOSSES:
            named, extra = NAMED_LOSSES[loss_fn], loss_fn_config or {}
            fixed = {"logprobs_B_T", "old_logprobs_B_T", "advantages", "weights_B_T"}
            try:
                if not isinstance(extra, dict) or fixed & set(extra):
                    raise TypeError(f"an object of the loss's settings, not {sorted(fixed & set(extra)) or extra!r}")
                inspect.signature(named).bind_partial(**extra)
                finite([v for v in extra.values() if isinstance(v, float)], "loss_fn_config")
            except TypeError as exc:
                raise RequestError(f"loss_fn_config: {exc}", "loss_fn_config") from None

            def fn(logprobs_B_T, batch):
                return named(logprobs_B_T, old_logprobs_B_T=batch.old_logprobs_B_T, advantages=batch.advantages,
                             weights_B_T=batch.weights_B_T, **extra)
        else:
            raise RequestError(f"loss_fn: {loss_fn!r} is not one of {', '.join(sorted(NAMED_LOSSES))}", "loss_fn")
        batch = self._batch(data)
        with self.lock:
            metrics = self._trainee(cid).backend.forward_backward(batch, fn)
        return {"metrics": metrics}

    def forward(self, cid: str, data: Any) -> dict[str, Any]:
        """Each datum's token logprobs under the client's current adapter (position 0 gets 0)."""
        batch = self._batch(data)
        with self.lock:
            logprobs = self._trainee(cid).backend.forward(batch)
        out: list[list[float]] = [[] for _ in data]
        for row, index in enumerate(batch.sample_index_B.tolist()):
            out[index] = logprobs[row, : int(batch.lengths_B[row])].tolist()
        return {"logprobs": out}

    def optim_step(self, cid: str, adam_params: dict | None = None) -> dict[str, Any]:
        """One AdamW step of the client's adapter; `adam_params`: learning_rate, beta1, beta2, eps,
        weight_decay, grad_clip_norm (0: none)."""
        p = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
             "grad_clip_norm": 0.0}
        if not isinstance(adam_params or {}, dict):
            raise RequestError("adam_params: an object of settings", "adam_params")
        unknown = set(adam_params or {}) - set(p)
        if unknown:
            raise RequestError(f"adam_params: unknown key(s) {sorted(unknown)}; known: {sorted(p)}", "adam_params")
        p |= adam_params or {}
        if not all(is_number(v) and 0 <= v < math.inf for v in p.values()) or not p["learning_rate"] > 0:
            raise RequestError("adam_params: every value a finite number >= 0, learning_rate > 0", "adam_params")
        with self.lock:
            backend = self._trainee(cid).backend
            for group in backend.optimizer.param_groups:
                group.update(lr=p["learning_rate"], betas=(p["beta1"], p["beta2"]), eps=p["eps"],
                             weight_decay=p["weight_decay"])
            backend.scheduler.base_lrs = [p["learning_rate"]] * len(backend.optimizer.param_groups)
            backend.max_grad_norm = p["grad_clip_norm"] or float("inf")
            return {"metrics": backend.optim_step()}

    # ----------------------------------------------------------------------------------- states and weights
    def _folder(self, cid: str, kind: str, name: Any) -> Path:
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError("name: 1-64 characters of letters, digits, '_', '.', '-'", "name")
        return self.root / cid / kind / name

    def _inside(self, path: Any, param: str) -> Path:
        if not isinstance(path, str):
            raise RequestError(f"{param}: a path returned by this server", param)
        found = Path(path).resolve()
        if not found.is_relative_to(self.root) or not found.is_dir():
            raise RequestError(f"{param}: {path!r} is not a saved folder of this server", param, 404)
        return found

    def _adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        mark = f".{adapter}."
        return {n.replace(mark, ".default."): p.detach().clone() for n, p in self.model.named_parameters()
                if mark in n}

    def _load_adapter_tensors(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        mine = {n.replace(f".{adapter}.", ".default."): p for n, p in self.model.named_parameters()
                if f".{adapter}." in n}
        if mine.keys() != tensors.keys() or any(mine[k].shape != tensors[k].shape for k in mine):
            raise RequestError("path: the saved weights do not fit this client's adapter (rank or modules differ)",
                               "path", 409)
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(tensors[k])

    def save_state(self, cid: str, name: str) -> dict[str, Any]:
        """Adapter weights and optimiser state, for `load_state` (resume)."""
        from safetensors.torch import save_file

        folder = self._folder(cid, "states", name)
        with self.lock:
            trainee = self._trainee(cid)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(self._adapter_tensors(cid), str(folder / "adapter.safetensors"))
            torch.save(trainee.backend.state_dict(), folder / "optimizer.pt")
        return {"path": str(folder)}

    def load_state(self, cid: str, path: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        folder = self._inside(path, "path")
        if not (folder / "optimizer.pt").is_file():
            raise RequestError(f"path: {path!r} is not a saved state (save_state)", "path", 404)
        with self.lock:
            trainee = self._trainee(cid)
            self._load_adapter_tensors(cid, load_file(str(folder / "adapter.safetensors")))
            trainee.backend.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        return {"path": str(folder)}

    def save_weights_for_sampler(self, cid: str, name: str) -> dict[str, Any]:
        """The adapter as a peft folder (adapter_config.json + adapter_model.safetensors), for
        `create_sampling_client(model_path=...)` or `PeftModel.from_pretrained(base, path)`."""
        folder = self._folder(cid, "sampler_weights", name)
        with self.lock:
            self._trainee(cid)
            self.model.save_pretrained(str(folder), selected_adapters=[cid])
        return {"path": str(folder / cid)}

    # ----------------------------------------------------------------------------------- sampling
    def create_sampling_client(self, model_path: str | None = None, client_id: str | None = None,
                               seed: int = 0) -> dict[str, Any]:
        """A sampler of saved sampler weights (`model_path`), or of a training client's current weights
        (`client_id`: a snapshot, unchanged by its later steps)."""
        if (model_path is None) == (client_id is None):
            raise RequestError("give one of model_path (saved sampler weights) or client_id", "model_path")
        check_seed(seed)
        with self.lock:
            if client_id is not None:  # one snapshot adapter per training client, sampled with its RNG
                trainee, sid = self._trainee(client_id), f"{client_id}-sampler"
                old = self.samplers.get(sid)
                if old is None:
                    cfg = trainee.config
                    self._add_adapter(sid, cfg["rank"], cfg["alpha"], 0, cfg["target_modules"])
                self._load_adapter_tensors(sid, self._adapter_tensors(client_id))
                self.samplers[sid] = Sampler(sid, trainee.engine, old.generation + 1 if old else 1)
                return {"sampler_id": f"{sid}:{self.samplers[sid].generation}"}
            folder = self._inside(model_path, "model_path")
            if not (folder / "adapter_config.json").is_file():
                raise RequestError(f"model_path: {model_path!r} holds no adapter", "model_path", 404)
            self.count += 1
            sid = f"s{self.count}"
            self._peft_load(folder, sid)
            self.samplers[sid] = Sampler(sid, HFEngine(self.model, self.tokenizer, seed=seed))
            return {"sampler_id": sid}

    def _peft_load(self, folder: Path, sid: str) -> None:
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(str(folder), adapter_name=sid)
        else:
            self.model = PeftModel.from_pretrained(self.model, str(folder), adapter_name=sid)

    def sample(self, sid: str, prompts: Any, params: dict | None = None) -> dict[str, Any]:
        """`params`: max_tokens, temperature, top_p, top_k, n, stop, greedy. Prompts are token-id lists or
        text (a string, or chat messages). Per prompt: its ids and `n` sequences (tokens, logprobs, text,
        stop_reason)."""
        known = set(SamplingParams.__dataclass_fields__)
        if not isinstance(params or {}, dict):
            raise RequestError("params: an object of sampling settings", "params")
        if set(params or {}) - known:
            raise RequestError(f"params: unknown key(s) {sorted(set(params or {}) - known)}; known: {sorted(known)}",
                               "params")
        try:
            sp = SamplingParams(**{k: tuple(v) if k == "stop" else v for k, v in (params or {}).items()})
        except TypeError as exc:
            raise RequestError(f"params: {exc}", "params") from None
        if not isinstance(sp.max_tokens, int) or not 1 <= sp.max_tokens <= 1 << 16 or not isinstance(sp.n, int) \
                or sp.n < 1 or not is_number(sp.temperature) or not 0 <= sp.temperature < math.inf \
                or not is_number(sp.top_p) or not 0 < sp.top_p <= 1 or not isinstance(sp.top_k, int) \
                or not 0 <= sp.top_k < 2**31 or not isinstance(sp.greedy, bool) \
                or not all(isinstance(t, str) and t for t in sp.stop):
            raise RequestError("params: max_tokens 1..65536, n >= 1, temperature a finite number >= 0, top_p in "
                               "(0, 1], top_k >= 0, greedy true or false, stop a list of non-empty strings", "params")
        if not isinstance(prompts, list) or not prompts or len(prompts) * sp.n > MAX_SAMPLES:
            raise RequestError(f"prompts: a non-empty list (prompts x n at most {MAX_SAMPLES})", "prompts")
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = [p if isinstance(p, list) and all(isinstance(t, int) for t in p) else self._encode(p, i)
               for i, p in enumerate(prompts)]
        for i, p in enumerate(ids):
            if not p or not all(0 <= t < vocab for t in p):
                raise RequestError(f"prompts.{i}: token ids must be in [0, {vocab}) (and at least one)", f"prompts.{i}")
        name, _, generation = str(sid).partition(":")
        with self.lock:
            sampler = self.samplers.get(name)
            if sampler is None:
                raise RequestError(f"no sampling client {sid!r}", "sid", 404)
            if generation and generation != str(sampler.generation):
                raise RequestError(f"sampling client {sid!r}: its weights were replaced by a newer "
                                   "save_weights_and_get_sampling_client; sample with that one", "sid", 409)
            self._use(name)
            got = sampler.engine.generate(ids, sp)
        return {"samples": [{"prompt_ids": p, "sequences": [
            {"tokens": list(c.token_ids), "logprobs": list(c.logprobs), "text": c.text,
             "stop_reason": c.stop_reason.value} for c in cs]} for p, cs in zip(ids, got)]}

    def _encode(self, prompt: Any, i: int) -> list[int]:
        if not isinstance(prompt, (str, list)) or not prompt:
            raise RequestError(f"prompts.{i}: token ids, a string or chat messages", f"prompts.{i}")
        try:
            return encode_prompt(self.tokenizer, prompt)
        except (TypeError, ValueError, KeyError) as exc:
            raise RequestError(f"prompts.{i}: {exc}", f"prompts.{i}") from None
