"""Continuous batching: one background thread owns the model and decodes every running request at once.

Requests arrive from any thread (`submit` returns a future); between two decode steps the loop admits the
waiting ones (one batched prefill, one prefill per request even with `n` samples, identical prompts read once),
merges their key/value states into the running batch and retires rows as they finish, so a short request
never waits for a long one and a new one never waits for the batch to drain.

The running batch is one right-aligned padded `DynamicCache` with a key mask and per-row positions (a row's
numbers do not depend on its neighbours); joining rows or the batch are left-padded to one width.

Weight updates and in-flight requests (the rule): `update_weights` waits until the loop is between steps
with no running rows. `stage_weights` returns at once instead: admission stops, the loop applies the
update itself once the running rows are done, then admits again (a second staged update before that merges
into the first, the newer tensors winning). Either way, no request submitted after the call returns runs on
the old weights. By default running requests *finish on the old weights* (admission pauses meanwhile),
so every completion comes from exactly one policy version, reported as `future.policy_version` (and as the
server's `policy_version`). With `interrupt=True` (or `interrupt_in_flight=True` at construction) running
requests end at once with `StopReason.ABORT` and their tokens so far — the "partial rollouts" an async
controller continues under the new weights. `abort_all()` does the same without an update.

    >>> engine = ContinuousEngine.from_pretrained("path/to/model", max_batch=64)      # doctest: +SKIP
    >>> future = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, n=2), seed=1) # doctest: +SKIP
    >>> [a, b] = future.result(timeout=60)                                            # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Self

import torch
import torch.nn.functional as F

from tokenmill.engines.base import EngineUnavailable
from tokenmill.engines.local.continuous_routes import RouteRecording
from tokenmill.engines.local.cuda_graphs import graphs_blocker
from tokenmill.engines.local.fast_decode import has_sliding_layers
from tokenmill.engines.local.graph_buckets import BucketedGraphs
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.paged import BlockPool, PagedKV
from tokenmill.engines.local.paged_decode import prefill_states
from tokenmill.engines.local.sampling import sample_rows
from tokenmill.types import Completion, PromptLogprobs, SamplingParams, StopReason

log = logging.getLogger("tokenmill.engines.local.continuous")
_IDLE_WAIT_S = 0.05  # how often an idle loop looks at its shutdown flag
_UNIFORM_BLOCK = 64  # sampling steps of uniform numbers drawn at once per request


class EngineBusy(EngineUnavailable):
    """The queue is full: retry later (the server answers 429)."""


class RequestFuture(Future):
    """`Future[list[Completion]]` plus where the request ran: the policy version of all its tokens and the
    loop steps at which it was admitted and finished (None until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy_version: int | None = None
        self.admitted_step: int | None = None
        self.finished_step: int | None = None
        self.abort_requested = False  # set by `ContinuousEngine.cancel`: its rows end at the next step


@dataclass(eq=False)
class _Staged:
    tensors: dict[str, torch.Tensor]
    version: int
    applied: threading.Event


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: RequestFuture
    generator: torch.Generator | None  # its own (seeded) generator, or None: the engine's
    max_tokens: int
    on_token: Callable[[int, int, float], None] | None = None  # (row index, token, logprob), from the loop
    results: list[Completion | None] = field(default_factory=list)
    # sampling randomness, drawn _UNIFORM_BLOCK steps at a time for all n rows (they advance in step)
    uniforms_N_K: list[list[float]] = field(default_factory=list)
    block_index: int = -1
    spec: tuple[float, float, float, float] = field(init=False)  # temperature, top_p, top_k, greedy

    def __post_init__(self) -> None:
        p = self.params
        self.spec = (p.temperature, p.top_p, float(p.top_k), float(p.greedy))

    @property
    def claim(self) -> int:  # key/value cache tokens its rows may fill: n x (prompt + max_tokens)
        return self.params.n * (len(self.prompt) + self.params.max_tokens)


@dataclass(eq=False)
class _Row:
    request: _Request
    index: int  # which of the request's n samples
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # what it read, while recording (`RouteRecording`)


class ContinuousEngine(RouteRecording, HFEngine):
    """An `InferenceEngine` whose `generate` and `submit` share one continuously batched decode loop.

    max_batch:           running rows at most (a request takes `n` rows)
    max_waiting:         queued requests at most; beyond, `submit` raises EngineUnavailable (the server: 429)
    max_prefill_tokens:  padded prompt tokens read in one admission step (at least one request is admitted)
    max_batch_tokens:    key/value cache the running rows may claim, each row its prompt + max_tokens (0: no
                         limit; a request alone in the batch is admitted whatever its size)
    interrupt_in_flight: default for `update_weights(interrupt=...)` (see the module docstring)
    request_timeout_s:   how long `generate` waits for its completions before cancelling them
    The model belongs to the engine's thread: do not train the same module while the engine runs.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, max_batch: int = 256, max_waiting: int = 4096,
                 max_prefill_tokens: int = 8192, interrupt_in_flight: bool = False,
                 request_timeout_s: float = 3600.0, autocast_dtype: torch.dtype | None = None,
                 prefix_cache_tokens: int = 0, fast_decode: bool = True, max_batch_tokens: int = 0,
                 kv_cache: str = "static", kv_block_size: int = 16, paged_attention: str = "auto",
                 cuda_graphs: bool = True, compile_step: bool = True) -> None:
        if has_sliding_layers(model.config):
            raise ValueError("ContinuousEngine needs full-attention layers (this model has sliding-window ones, "
                             "whose caches cannot be re-aligned); use HFEngine")
        if max_batch < 1 or max_waiting < 1 or max_prefill_tokens < 1:
            raise ValueError(f"need max_batch, max_waiting, max_prefill_tokens >= 1, got {max_batch}, "
                             f"{max_waiting}, {max_prefill_tokens}")
        super().__init__(model, tokenizer, seed=seed, autocast_dtype=autocast_dtype,
                         prefix_cache_tokens=prefix_cache_tokens, fast_decode=fast_decode,
                         max_batch_tokens=max_batch_tokens, cuda_graphs=False, kv_cache=kv_cache,
                         kv_block_size=kv_block_size, paged_attention=paged_attention)
        # over the paged cache, one CUDA graph per batch-size bucket (`engines.local.graph_buckets`)
        self.cuda_graphs_off = ("the continuous batch changes shape every step (rows join and leave): "
                                "graphs need kv_cache: paged" if self.paged.off is not None else
                                "turned off" if not cuda_graphs else graphs_blocker(self.device) or (
                                    None if self.paged.backend == "flex" else "graphs need paged_attention: flex"))
        self._buckets = (BucketedGraphs(self._fast, max_batch, compile=compile_step) if self.cuda_graphs_off is None
                         else None)
        self._pool: BlockPool | None = None  # the paged cache's blocks, kept across steps and requests
        self.model.eval()
        self.max_batch, self.max_waiting, self.max_prefill_tokens = max_batch, max_waiting, max_prefill_tokens
        self.interrupt_in_flight = interrupt_in_flight
        self.request_timeout_s = request_timeout_s
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.steps = self.prefills = self.generated_tokens = 0
        # the running batch (touched by the loop thread only)
        self._rows: list[_Row] = []
        self._cache = None
        self._mask_B_L = self._pos_B = self._tok_B = None
        # shared with callers, under self._cond
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._pauses = 0  # callers waiting for (or holding) a pause between steps
        self._abort = False  # abort the running requests at the next step
        self._parked = False
        self._closed = False
        self._error: BaseException | None = None
        self._update_lock = threading.Lock()
        self._staged: _Staged | None = None  # an update for the loop to apply between steps (stage_weights)
        self._working = False  # the loop is admitting or decoding (set under self._cond)
        self._thread = threading.Thread(target=self._run, name="tokenmill-continuous", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str, *, dtype=torch.float32, device: str = "cpu", seed: int = 0,
                        prefix_cache_tokens: int = 0, **kwargs) -> ContinuousEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), seed=seed, prefix_cache_tokens=prefix_cache_tokens,
                   **kwargs)

    # ------------------------------------------------------------------------------------------ callers
    def submit(self, prompt_ids: list[int], params: SamplingParams, *, seed: int | None = None,
               on_token: Callable[[int, int, float], None] | None = None) -> RequestFuture:
        """Queue one prompt for `params.n` samples; the future resolves to n completions. Thread-safe.
        With `seed`, the request samples from its own generator: the same seed gives the same tokens whatever
        else runs beside it (up to float ties). `on_token(row, token, logprob)` is called from the engine's
        thread for each sampled token (streaming); it must be quick and must not raise."""
        prompt = [int(t) for t in prompt_ids]
        self._check_request(prompt, params)
        max_tokens = min(params.max_tokens, (self.max_positions or 1 << 62) - len(prompt))
        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(int(seed))
        request = _Request(prompt, params, RequestFuture(), generator, max_tokens, on_token, [None] * params.n)
        with self._cond:
            self._check_alive()
            if len(self._waiting) >= self.max_waiting:
                raise EngineBusy(f"engine queue is full ({self.max_waiting} waiting requests); retry later")
            self._waiting.append(request)
            self._cond.notify_all()
        return request.future

    def _check_request(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt: needs at least one token")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if self.max_positions and len(prompt) >= self.max_positions:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room to generate (the model's context is "
                             f"{self.max_positions} positions)")
        if params.max_tokens < 1 or params.n < 1:
            raise ValueError(f"max_tokens and n must be >= 1, got {params.max_tokens}, {params.n}")
        if params.n > self.max_batch:
            raise ValueError(f"n: {params.n} samples exceed the engine's max_batch ({self.max_batch})")
        if not params.greedy and params.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 when sampling, got {params.temperature}")

    def cancel(self, future: RequestFuture) -> None:
        """Give up on a request: dropped if still queued, else its rows end at the next step (ABORT)."""
        with self._cond:
            future.abort_requested = True
            for request in self._waiting:
                if request.future is future:
                    self._waiting.remove(request)
                    future.cancel()
                    return

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        futures = [self.submit(p, params) for p in prompts]
        deadline = time.monotonic() + self.request_timeout_s
        try:
            return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
        except TimeoutError:
            for f in futures:
                self.cancel(f)
            raise TimeoutError(f"generate: no answer within request_timeout_s={self.request_timeout_s:g}s") from None

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       interrupt: bool | None = None, timeout_s: float = 600.0) -> None:
        """Copy new weights in between steps, bump `version` and clear the prefix cache. Running requests
        finish on the old weights first, or end now with ABORT when `interrupt` (module docstring)."""
        with self.paused(interrupt=self.interrupt_in_flight if interrupt is None else interrupt,
                         timeout_s=timeout_s):
            self._apply_staged()  # an older staged update lands first, so versions never go back
            super().update_weights(named_tensors, version)

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                      interrupt: bool | None = None) -> tuple[threading.Event, bool]:
        """Queue an update for the loop and return at once: (an event set once it is applied, whether rows
        were running or waiting, so that applying must wait for them). The tensors are the engine's to keep
        (no copy is made until they are applied). Running requests finish on the old weights, or end now
        with ABORT when `interrupt`; requests submitted after this call run on the new ones."""
        tensors = dict(named_tensors)
        with self._cond:
            self._check_alive()
            busy = bool(self._working or self._rows or self._waiting)
            if self._staged is None:
                self._staged = _Staged(tensors, version, threading.Event())
            else:  # not applied yet: one update, the newer tensors and version winning
                self._staged.tensors.update(tensors)
                self._staged.version = version
            self._abort = self._abort or (self.interrupt_in_flight if interrupt is None else interrupt)
            self._cond.notify_all()
            return self._staged.applied, busy

    @property
    def pending_version(self) -> int:
        """The version requests submitted now will run on: a staged update's, else the loaded one."""
        staged = self._staged
        return self.version if staged is None else staged.version

    def _apply_staged(self) -> None:
        """Load the staged update, if any (from the loop between steps, or a caller holding a pause)."""
        with self._cond:
            staged, self._staged = self._staged, None
        if staged is not None:
            try:
                with torch.no_grad():
                    HFEngine.update_weights(self, staged.tensors.items(), staged.version)
            finally:
                staged.applied.set()

    def score_ranked(self, sequences: list[list[int]], top_k: int = 0) -> list[tuple[PromptLogprobs, tuple[int, ...]]]:
        """`HFEngine.score_ranked` beside the running decode, never across a weight update (so `score` too),
        and on the weights staged before the call (it waits for them to be applied)."""
        while True:
            staged = self._staged
            if staged is not None and not staged.applied.wait(self.request_timeout_s):
                raise TimeoutError(f"score: staged weights not applied within {self.request_timeout_s:g}s")
            with self._update_lock:
                self._check_alive()
                if self._staged is None:
                    return super().score_ranked(sequences, top_k)

    def abort_all(self, timeout_s: float = 60.0) -> None:
        """End every running request now (ABORT, tokens so far); queued ones stay queued."""
        with self.paused(interrupt=True, timeout_s=timeout_s):
            pass

    @contextlib.contextmanager
    def paused(self, *, interrupt: bool = False, timeout_s: float = 600.0) -> Iterator[None]:
        """Hold the loop between steps with no running rows (waiting for them to finish, or aborting them
        with `interrupt`): the model may be changed inside. Raises TimeoutError if that takes longer."""
        with self._update_lock:
            with self._cond:
                self._check_alive()
                self._pauses += 1
                self._abort = self._abort or interrupt
                self._cond.notify_all()
                ok = self._cond.wait_for(lambda: self._parked or self._error is not None or self._closed,
                                         timeout_s)
                if not ok or not self._parked:
                    self._pauses -= 1
                    self._cond.notify_all()
                    self._check_alive()
                    raise TimeoutError(f"the running requests did not finish within {timeout_s:g}s "
                                       "(pass interrupt=True to end them at once)")
            try:
                yield
            finally:
                with self._cond:
                    self._pauses -= 1
                    self._cond.notify_all()

    def stats(self) -> dict[str, int]:  # len() needs no lock
        return {"running_rows": len(self._rows), "waiting_requests": len(self._waiting), "steps": self.steps,
                "prefills": self.prefills, "generated_tokens": self.generated_tokens, "policy_version": self.version,
                "kv_blocks_used": 0 if self._pool is None else self._pool.used_blocks}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests not finished fail with EngineUnavailable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineUnavailable(f"engine loop crashed: {type(self._error).__name__}: {self._error}") \
                from self._error
        if self._closed:
            raise EngineUnavailable("engine is closed")

    # ------------------------------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            with torch.inference_mode(), self._autocast():
                while self._one_iteration():
                    pass
            cause: BaseException = EngineUnavailable("engine is closed")
        except BaseException as exc:  # every waiting caller gets the cause
            log.exception("continuous engine loop crashed")
            cause = EngineUnavailable(f"engine loop crashed: {type(exc).__name__}: {exc}")
            cause.__cause__ = exc
            with self._cond:
                self._error = exc
        with self._cond:
            doomed = list(self._waiting) + list({id(r.request): r.request for r in self._rows}.values())
            self._waiting.clear()
            self._rows, self._cache = [], None
            if self._staged is not None:  # never applied: wake whoever waits for it (they find the engine closed)
                self._staged.applied.set()
            self._cond.notify_all()
        for request in doomed:
            if not request.future.done():
                request.future.set_exception(cause)

    def _one_iteration(self) -> bool:
        """Admit, decode one token, retire; or park for a weight update; or idle. False: shut down."""
        with self._cond:
            if self._closed:
                return False
            abort, self._abort = self._abort, False
            if (self._pauses or self._staged) and (abort or not self._rows):
                if abort:
                    self._abort_running()
                # a staged update is applied here, unless a caller holds the update lock (its pause goes first)
                if self._staged is not None and not self._pauses and self._update_lock.acquire(blocking=False):
                    try:
                        self._cond.release()  # callers may queue requests meanwhile (admitted after)
                        try:
                            self._apply_staged()
                        finally:
                            self._cond.acquire()
                    finally:
                        self._update_lock.release()
                    return True
                if not self._pauses:  # the update lock's holder is about to pause
                    self._cond.wait(_IDLE_WAIT_S)
                    return True
                self._parked = True
                self._cond.notify_all()
                while self._pauses and not self._closed:
                    self._cond.wait(_IDLE_WAIT_S)
                self._parked = False
                return not self._closed
            admit = [] if self._pauses or self._staged else self._take_admissible()
            self._working = bool(admit or self._rows)  # taken requests are in neither list until admitted
            if not admit and not self._rows:
                self._cond.wait(_IDLE_WAIT_S)
                return True
        if admit:
            self._admit(admit)
        if self._rows:
            self._decode_step()
        return True

    def _take_admissible(self) -> list[_Request]:
        """Queued requests that fit (rows and prefill budget), in arrival order; cancelled ones are dropped."""
        taken: list[_Request] = []
        rows, longest = len(self._rows), 0
        claimed = sum(r.request.claim // r.request.params.n for r in self._rows)
        while self._waiting:
            request = self._waiting[0]
            if request.future.cancelled():
                self._waiting.popleft()
                continue
            longest_if = max(longest, len(request.prompt))
            over_tokens = bool(self.max_batch_tokens) and rows > 0 and (
                claimed + request.claim > self.max_batch_tokens)
            if over_tokens or (taken and longest_if * (len(taken) + 1) > self.max_prefill_tokens):
                break
            if rows + request.params.n > self.max_batch:
                break
            self._waiting.popleft()
            if not request.future.set_running_or_notify_cancel():
                continue
            taken.append(request)
            rows, longest, claimed = rows + request.params.n, longest_if, claimed + request.claim
        return taken

    def _admit(self, requests: list[_Request]) -> None:
        """One batched prefill of the requests' distinct prompts; each gets n rows sampling their first token;
        the rows that go on join the running batch."""
        unique: dict[tuple[int, ...], int] = {}
        for r in requests:
            unique.setdefault(tuple(r.prompt), len(unique))
            r.future.policy_version, r.future.admitted_step = self.version, self.steps
        source = [unique[tuple(r.prompt)] for r in requests for _ in range(r.params.n)]
        rows = [_Row(r, i) for r in requests for i in range(r.params.n)]
        self.prefills += 1
        if self.paged.off is None:
            self._admit_paged([list(p) for p in unique], source, rows)
            return
        logits_P_V, cache, mask_P_L, pos_P = self._prefill([list(p) for p in unique])
        index_N = torch.tensor(source, device=self.device)
        if source != list(range(len(unique))):
            cache.batch_select_indices(index_N)
            logits_P_V, mask_P_L, pos_P = logits_P_V[index_N], mask_P_L[index_N], pos_P[index_N]
        tok_N, keep = self._advance(rows, logits_P_V)
        if keep:
            self._join(rows, keep, cache, mask_P_L, pos_P, tok_N)

    def _admit_paged(self, prompts: list[list[int]], source: list[int], rows: list[_Row]) -> None:
        """`_admit` over the paged cache: the rows of one prompt share its full blocks; rows that finish at
        their first token give theirs back at once."""
        logits_P_V, prefill, mask_P_L, pos_P = self._prefill(prompts, extra=0)
        self._pool = self._pool or self.paged.pool(len(self._fast.layers), self.max_batch_tokens)
        self._cache = self._cache if self._cache is not None else PagedKV(self._pool, self.paged.backend)
        before = len(self._cache)
        self._cache.add_rows(*prefill_states(prefill, mask_P_L), source)
        index_N = torch.tensor(source, device=self.device)
        tok_N, keep = self._advance(rows, logits_P_V[index_N])
        self._cache.batch_select_indices(list(range(before)) + [before + k for k in keep])
        keep_K = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._rows = self._rows + [rows[k] for k in keep]
        self._pos_B = torch.cat([*([] if self._pos_B is None else [self._pos_B]), pos_P[index_N][keep_K]])
        self._tok_B = torch.cat([*([] if self._tok_B is None else [self._tok_B]), tok_N[keep_K]])

    def _decode_step_paged(self) -> None:
        logits_B_V = self._step(self._tok_B, self._pos_B, None, self._cache)  # graphed per bucket where it can
        self._pos_B, self.steps = self._pos_B + 1, self.steps + 1
        tok_B, keep = self._advance(self._rows, logits_B_V)
        keep_K = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(keep)  # finished rows leave; their blocks go back to the pool
        self._rows, self._pos_B, self._tok_B = [self._rows[r] for r in keep], self._pos_B[keep_K], tok_B[keep_K]

    def _decode_step(self) -> None:
        if isinstance(self._cache, PagedKV):
            self._decode_step_paged()
            return
        mask_B_L = torch.cat([self._mask_B_L, self._mask_B_L.new_ones((len(self._rows), 1))], dim=1)
        logits_B_V = self._step(self._tok_B, self._pos_B, None if bool(mask_B_L.all()) else mask_B_L, self._cache)
        self._mask_B_L, self._pos_B = mask_B_L, self._pos_B + 1
        self.steps += 1
        tok_B, keep = self._advance(self._rows, logits_B_V)
        if len(keep) == len(self._rows):
            self._tok_B = tok_B
            return
        if not keep:
            self._rows, self._cache = [], None
            return
        keep_K = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(keep_K)
        self._rows = [self._rows[r] for r in keep]
        self._mask_B_L, self._pos_B, self._tok_B = self._mask_B_L[keep_K], self._pos_B[keep_K], tok_B[keep_K]
        first = int(self._mask_B_L.any(dim=0).int().argmax())  # columns left of it serve no live row
        if first:
            self._mask_B_L = self._mask_B_L[:, first:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _join(self, rows: list[_Row], keep: list[int], cache, mask_N_L, pos_N, tok_N) -> None:
        """Add the kept new rows to the running batch, both right-aligned to the wider of the two caches."""
        if len(keep) < len(rows):
            keep_K = torch.tensor(keep, dtype=torch.long, device=self.device)
            cache.batch_select_indices(keep_K)
            mask_N_L, pos_N, tok_N = mask_N_L[keep_K], pos_N[keep_K], tok_N[keep_K]
        new_rows = [rows[r] for r in keep]
        if not self._rows:
            self._rows, self._cache, self._mask_B_L, self._pos_B, self._tok_B = new_rows, cache, mask_N_L, pos_N, tok_N
            return
        width = max(self._mask_B_L.shape[1], mask_N_L.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask_B_L = torch.cat([_left_pad(self._mask_B_L, width, dim=1), _left_pad(mask_N_L, width, dim=1)])
        self._pos_B = torch.cat([self._pos_B, pos_N])
        self._tok_B = torch.cat([self._tok_B, tok_N])
        self._rows = self._rows + new_rows

    # ------------------------------------------------------------------------------------ rows and results
    def _advance(self, rows: list[_Row], logits_B_V: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Sample one token per row, record it, finish the rows that are done; return the tokens and the
        indices of the rows that go on."""
        self._record_routes(rows)
        tok_B, logp_B = self._sample(rows, logits_B_V)
        keep: list[int] = []
        for r, (row, t, lp) in enumerate(zip(rows, tok_B.tolist(), logp_B.tolist(), strict=True)):
            row.tokens.append(t)
            row.logprobs.append(lp)
            if row.request.on_token is not None:
                row.request.on_token(row.index, t, lp)
            reason = self._stop_reason(row, t)
            if reason is None:
                keep.append(r)
            else:
                self._finish(row, reason)
        self.generated_tokens += len(rows)
        return tok_B, keep

    def _sample(self, rows: list[_Row], logits_B_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched sampling call for all rows, whatever their parameters (one small table per step)."""
        table = []
        for row in rows:
            request, step = row.request, len(row.tokens)
            if step // _UNIFORM_BLOCK != request.block_index:
                # the request's own generator (seeded: the same draws whatever runs beside it) or the engine's
                request.block_index = step // _UNIFORM_BLOCK
                request.uniforms_N_K = torch.rand((request.params.n, _UNIFORM_BLOCK), device=self.device,
                                                  generator=request.generator or self.generator).tolist()
            table.append((*request.spec, request.uniforms_N_K[row.index][step % _UNIFORM_BLOCK]))
        table_B_5 = torch.tensor(table, dtype=torch.float64, device=logits_B_V.device)
        return sample_rows(logits_B_V, temperature=table_B_5[:, 0], top_p=table_B_5[:, 1],
                           top_k=table_B_5[:, 2].long(), greedy=table_B_5[:, 3].bool(), uniform_B=table_B_5[:, 4])

    def _stop_reason(self, row: _Row, token: int) -> StopReason | None:
        request = row.request
        stops = request.params.stop
        if token in self.eos_ids:
            return StopReason.STOP
        if stops and self._hit_stop(row.tokens, stops, max(len(s) for s in stops)):
            return StopReason.STOP
        if len(row.tokens) >= request.max_tokens:
            return StopReason.LENGTH
        if request.future.abort_requested:
            return StopReason.ABORT
        return None

    def _finish(self, row: _Row, reason: StopReason) -> None:
        request = row.request
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        done = self._completion(row.tokens, row.logprobs, reason, text, request.params)
        request.results[row.index] = self._with_routes(row, done)
        if all(c is not None for c in request.results) and not request.future.done():
            request.future.finished_step = self.steps
            request.future.set_result(list(request.results))

    def _abort_running(self) -> None:
        for row in self._rows:
            self._finish(row, StopReason.ABORT)
        if isinstance(self._cache, PagedKV):
            self._cache.release_all()
        self._rows, self._cache = [], None
        self._mask_B_L = self._pos_B = self._tok_B = None


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad `t` on the left of `dim` to `width` (keys/values [B, H, T, D]: dim 2; masks [B, T]: dim 1)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [missing, 0])
