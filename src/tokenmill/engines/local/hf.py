"""A transformers-based engine: the whole batch (all groups) decoded at once with a KV cache.

Why not `model.generate`: we need the logprob of every sampled token, one prefill per *unique* prompt
(a GRPO group of G samples shares its prompt: prefill once, then repeat the cache G times), and rows
that finished dropped from the batch so long completions do not make short ones pay.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from tokenmill.engines.local.cuda_graphs import GraphedDecode, graphs_blocker
from tokenmill.engines.local.fast_decode import (
    FastDecoder,
    StaticKV,
    causal_lm,
    fast_decode_blocker,
    has_forward_hooks,
    has_sliding_layers,
)
from tokenmill.engines.local.graph_buckets import BucketedGraphs
from tokenmill.engines.local.paged import PagedKV
from tokenmill.engines.local.paged_decode import PagedOptions, decode_on_device
from tokenmill.engines.local.prefix_cache import PrefixCache
from tokenmill.engines.local.routing import concat_routes, fit_routes, prompt_routes
from tokenmill.engines.local.sampling import sample_tokens
from tokenmill.types import Completion, PromptLogprobs, SamplingParams, StopReason


def cache_keyword(model) -> str:
    """The forward's keyword for the key/value cache: `cache` where the causal LM's forward takes it
    (transformers 5.24 deprecates `past_key_values`, to be removed in 5.40), else `past_key_values`."""
    forward = causal_lm(model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def prefill_allowed(mask_P_K: torch.Tensor, past: int = 0) -> torch.Tensor:
    """bool `[P, L, past + L]`: causal + key padding for left-padded prompts read after `past` cached columns
    (`mask_P_K`: 1 = a real key); a pad query attends to itself only, so no softmax row is empty."""
    keys = mask_P_K.shape[1]
    width = keys - past
    causal_L_K = torch.ones((width, keys), dtype=torch.bool, device=mask_P_K.device).tril(diagonal=past)
    allowed = causal_L_K & mask_P_K.bool()[:, None, :]
    allowed[:, :, past:] |= torch.eye(width, dtype=torch.bool, device=mask_P_K.device)
    return allowed


def token_batches(prompt_lens: list[int], params: SamplingParams, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive prompt ranges `[start, stop)` decoded together: each batch's key/value cache, n rows per
    prompt of (its longest prompt + `params.max_tokens`) tokens, stays within `max_tokens` (0: one batch).
    A prompt whose own rows exceed the budget is decoded alone."""
    if not max_tokens:
        return [(0, len(prompt_lens))]
    ranges, start, longest = [], 0, 0
    for i, length in enumerate(prompt_lens):
        wider = max(longest, length)
        if i > start and params.n * (i + 1 - start) * (wider + params.max_tokens) > max_tokens:
            ranges.append((start, i))
            start, wider = i, length
        longest = wider
    return ranges + [(start, len(prompt_lens))]


class HFEngine:
    """In-process engine over a transformers causal LM (which may be the trainer's own module)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        seed: int = 0,
        compact_fraction: float = 0.25,
        autocast_dtype: torch.dtype | None = None,
        prefix_cache_tokens: int = 0,
        fast_decode: bool = True,
        cuda_graphs: bool = True,
        compile_step: bool = True,
        max_batch_tokens: int = 0,
        kv_cache: str = "static",
        kv_block_size: int = 16,
        paged_attention: str = "auto",
        sample_on_device: bool = False,
        sample_chunk: int = 8,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {e for e in eos_list + [tokenizer.eos_token_id] if e is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.compact_fraction = compact_fraction
        if max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens: must be >= 0 (0 = no limit), got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens  # rows x (longest prompt + max_tokens) per decode batch
        self.autocast_dtype = autocast_dtype
        self.version = 0
        self.memory_releases = 0  # release_memory calls (a colocated run: one per step)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._cache_keyword = cache_keyword(model)
        self.prefix_cache: PrefixCache | None = None
        self.enable_prefix_cache(prefix_cache_tokens)
        # decode steps through `FastDecoder` (same numbers, less per-token work) unless turned off or the model
        # is not one it knows; `fast_decode_off` says why it is off
        self.fast_decode_off = "turned off" if not fast_decode else fast_decode_blocker(model)
        self._fast = FastDecoder(model) if self.fast_decode_off is None else None
        # on a GPU the fast step replays from a CUDA graph (`engines.local.cuda_graphs`); `cuda_graphs_off` says why not
        self.cuda_graphs_off = ("turned off" if not cuda_graphs else self.fast_decode_off
                                or graphs_blocker(self.device))
        self._graphed = (GraphedDecode(self._fast, compile=compile_step) if self.cuda_graphs_off is None
                         else None)
        # the paged key/value cache (`engines.local.paged`) and sampling on the device (`paged_decode`)
        self.paged = PagedOptions.of(self, kv_cache, kv_block_size, paged_attention, sample_on_device, sample_chunk)
        self._buckets = (BucketedGraphs(self._fast, compile=compile_step) if self.paged.off is None and
                         self.cuda_graphs_off is None and self.paged.backend == "flex" else None)
        self._routing = None  # a RoutingRecorder while `record_routing(True)`

    def record_routing(self, on: bool = True) -> None:
        """Record a mixture-of-experts model's expert choice for every token it reads (`Completion.routes`),
        for router replay in the trainer. Recording reads the routers through forward hooks, so it decodes
        with the transformers forward (no fast step, no CUDA graph) and without the prefix cache."""
        from tokenmill.engines.local.routing import RoutingRecorder

        if self._routing is not None:
            self._routing.close()
            self._routing = None
        if on:
            self._routing = RoutingRecorder(self.model)
            self._routing.active = False  # only while generating: the module may be the trainer's
            self._fast = self._graphed = self.prefix_cache = self._buckets = None
            self.fast_decode_off = self.cuda_graphs_off = "recording the MoE routing"
            self.paged.off = self.paged.on_device_off = "recording the MoE routing"

    def kv_bytes_per_token(self) -> int:
        """Bytes of key/value state one token takes in the cache (all layers)."""
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = self.autocast_dtype or next(self.model.parameters()).dtype
        return 2 * c.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8

    def enable_prefix_cache(self, capacity_tokens: int, block: int = 16) -> None:
        """Keep the key/value states of up to `capacity_tokens` prompt tokens, so that a prompt extending one
        read before (the next turn of an episode) reads only its new tokens; 0 turns it off. Models with
        sliding-window layers are left uncached."""
        if has_sliding_layers(self.model.config):
            capacity_tokens = 0
        self.prefix_cache = PrefixCache(capacity_tokens, block) if capacity_tokens else None

    @classmethod
    def from_pretrained(cls, path: str, *, dtype=torch.float32, device: str = "cpu", seed: int = 0,
                        prefix_cache_tokens: int = 0) -> HFEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), seed=seed, prefix_cache_tokens=prefix_cache_tokens)

    # ------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        own = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            target = own[name]
            if target.data_ptr() != tensor.data_ptr():  # a shared module needs no copy
                target.copy_(tensor.to(dtype=target.dtype, device=target.device))
        self.version = version
        if self.prefix_cache is not None:  # states of the old weights
            self.prefix_cache.clear()

    def state_dict(self) -> dict[str, Any]:
        """The sampling RNG (a checkpoint keeps it, so a resumed run draws the same stream)."""
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["rng"])

    def close(self) -> None:
        """Nothing to release (the module belongs to the caller)."""

    # what holds device memory between `generate` calls: (attribute, how it lets go, how it comes back or None:
    # rebuilt by the next call as needed). A cache added to the engine adds its line here.
    MEMORY_HOLDERS: tuple[tuple[str, str, str | None], ...] = (
        ("_graphed", "reset", None),  # the recorded CUDA graph and the key/value buffers it was recorded over
        ("prefix_cache", "clear", None),  # key/value states of prompts read before
        ("_buckets", "reset", None),  # the CUDA graphs per batch bucket over the paged cache, and their pool
    )

    def release_memory(self) -> int:
        """Free what the engine keeps on the device between calls (`MEMORY_HOLDERS`), the in-process
        counterpart of vLLM's sleep mode: a colocated run calls it before the trainer updates in the same
        memory. The weights stay (they are the trainer's). Returns the bytes the CUDA allocator gave back to the
        device (0 on a CPU)."""
        for attr, release, _ in self.MEMORY_HOLDERS:
            holder = getattr(self, attr, None)
            if holder is not None:
                getattr(holder, release)()
        self.memory_releases += 1
        if self.device.type != "cuda":
            return 0
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)

    def restore_memory(self) -> None:
        """Before decoding again: the holders that allocate ahead (a restore method in `MEMORY_HOLDERS`) do;
        the others are rebuilt by the next call."""
        for attr, _, restore in self.MEMORY_HOLDERS:
            holder = getattr(self, attr, None)
            if holder is not None and restore is not None:
                getattr(holder, restore)()

    def score(self, sequences: list[list[int]], top_k: int = 0) -> list[PromptLogprobs]:
        """`Scorer`: each token's teacher-forced logprob at temperature 1 (`tokenmill.engines.local.scoring`)."""
        return [scored for scored, _ in self.score_ranked(sequences, top_k)]

    def score_ranked(self, sequences: list[list[int]], top_k: int = 0) -> list[tuple[PromptLogprobs, tuple[int, ...]]]:
        """`score`, with each scored token's rank in its position's distribution (1: the most likely)."""
        from tokenmill.engines.local.scoring import check_score_request, score_sequences

        vocab = self.model.get_input_embeddings().weight.shape[0]
        seqs = check_score_request(sequences, top_k, vocab, self.max_positions)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self._autocast():
                return score_sequences(self.model, seqs, top_k=top_k, pad_id=self.pad_id)
        finally:
            self.model.train(was_training)

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        was_training = self.model.training
        self.model.eval()
        if self._routing is not None:
            self._routing.active = True
        try:
            with torch.inference_mode(), self._autocast():
                rows = []
                for start, stop in token_batches([len(p) for p in prompts], params, self.max_batch_tokens):
                    rows += self._decode(prompts[start:stop], params)
        finally:
            self.model.train(was_training)
            if self._routing is not None:
                self._routing.active = False
                self._routing.discard()
            if self._graphed is not None:  # its recording reads this call's buffers (and autocast's copies)
                self._graphed.reset()
            if self._buckets is not None:
                self._buckets.reset()
        n = params.n
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _prefill(self, prompts: list[list[int]], extra: int | None = None, repeat: int = 1):
        """Read the prompts (left-padded) into a fresh cache; return the last logits, the cache, the key mask
        and each row's next position. With a prefix cache, each row's stored prefix goes into the cache
        first (left-padded to the longest prefix) and only the rest of the prompt is read. With `extra` on
        the fast path the cache is a `StaticKV` `extra` columns wider with each row `repeat`ed (what the
        decode needs); otherwise a `DynamicCache` of the prompt rows."""
        prefixes = [self.prefix_cache.match(p) for p in prompts] if self.prefix_cache else [(None, 0)] * len(prompts)
        reused = [n for _, n in prefixes]
        past = max(reused)
        suffixes = [p[n:] for p, n in zip(prompts, reused, strict=True)]
        lengths = [len(x) for x in suffixes]
        width = max(lengths)
        ids_P_L = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask_P_L = torch.zeros((len(prompts), past + width), dtype=torch.long)
        pos_P_L = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, (x, n) in enumerate(zip(suffixes, reused, strict=True)):
            ids_P_L[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask_P_L[i, past - n : past] = 1
            mask_P_L[i, past + width - len(x) :] = 1
            pos_P_L[i, width - len(x) :] = torch.arange(n, n + len(x))
        ids_P_L, mask_P_L, pos_P_L = (t.to(self.device) for t in (ids_P_L, mask_P_L, pos_P_L))
        padded = not bool(mask_P_L.all())
        if extra is not None and self._fast is not None and self.prefix_cache is None and not has_forward_hooks(self.model):
            static = StaticKV.empty(len(self._fast.layers), width)
            mask = prefill_allowed(mask_P_L)[:, None] if padded else None
            hidden_P_1_H = self._fast.hidden(ids_P_L, pos_P_L, mask, static, positions=width)[:, -1:]
            logits_P_V = self._fast.head(hidden_P_1_H)[:, 0, :]
            if extra or repeat > 1:
                static = StaticKV.from_dynamic(static, extra, repeat)
            return logits_P_V, static, mask_P_L, pos_P_L[:, -1] + 1
        cache = DynamicCache(config=self.model.config)
        if past:
            self._load_prefixes(cache, prefixes, past)
        out = self.model(
            input_ids=ids_P_L,
            attention_mask=self._prefill_mask(mask_P_L, past) if padded else None,
            position_ids=pos_P_L,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: cache},
        )
        if self.prefix_cache is not None:
            self._store_prefixes(cache, prompts, lengths, reused, past, width)
        return out.logits[:, -1, :], cache, mask_P_L, pos_P_L[:, -1] + 1

    def _load_prefixes(self, cache: DynamicCache, prefixes, past: int) -> None:
        """Put each row's stored prefix states into `cache`, right-aligned in `past` columns."""
        template = next(kv for kv, _ in prefixes if kv is not None)
        for layer, (k0, v0) in enumerate(template):
            keys = k0.new_zeros((len(prefixes), k0.shape[0], past, k0.shape[-1]))
            values = v0.new_zeros((len(prefixes), v0.shape[0], past, v0.shape[-1]))
            for i, (kv, n) in enumerate(prefixes):
                if kv is not None:
                    keys[i, :, past - n :] = kv[layer][0]
                    values[i, :, past - n :] = kv[layer][1]
            cache.update(keys, values, layer)

    def _store_prefixes(self, cache: DynamicCache, prompts, lengths, reused, past: int, width: int) -> None:
        for i, prompt in enumerate(prompts):
            kv = []
            for layer in cache.layers:
                k, v = layer.keys[i], layer.values[i]  # [H, past + width, D]
                cols = slice(past + width - lengths[i], past + width)
                if reused[i]:
                    old = slice(past - reused[i], past)
                    kv.append((torch.cat([k[:, old], k[:, cols]], 1), torch.cat([v[:, old], v[:, cols]], 1)))
                else:
                    kv.append((k[:, cols], v[:, cols]))
            self.prefix_cache.insert(prompt, kv)

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        paged = self.paged.off is None and not has_forward_hooks(self.model)
        if paged and self.paged.on_device_off is None and not params.stop:
            return decode_on_device(self, prompts, params)
        n = params.n
        logits_B_V, cache, mask_B_L, next_pos_B = self._prefill(prompts, extra=0 if paged else params.max_tokens,
                                                                repeat=1 if paged else n)
        routes = self._prompt_routes(prompts, n) if self._routing is not None else None
        if paged:  # n rows per prompt sharing its full blocks
            cache = self.paged.cache(cache, mask_B_L, n, params.max_tokens, round_up=self._buckets is not None)
        elif not isinstance(cache, StaticKV):  # the transformers prefill (the fast one is a StaticKV already)
            if self._fast is not None and not has_forward_hooks(self.model):  # buffers for the whole completion
                cache = StaticKV.from_dynamic(cache, extra=params.max_tokens, repeat=n)
            elif n > 1:
                cache.batch_repeat_interleave(n)
        if n > 1:
            logits_B_V = logits_B_V.repeat_interleave(n, dim=0)
            mask_B_L = mask_B_L.repeat_interleave(n, dim=0)
            next_pos_B = next_pos_B.repeat_interleave(n, dim=0)
        total = len(prompts) * n
        max_tokens = params.max_tokens
        if self.max_positions:
            max_tokens = max(1, min(max_tokens, self.max_positions - max(len(p) for p in prompts)))
        tokens: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        reasons: list[StopReason | None] = [None] * total
        live = list(range(total))  # batch row -> sequence index
        done_in_batch = 0
        stop_window = max((len(s) for s in params.stop), default=0)
        padded = not bool(mask_B_L.all())
        for step in range(max_tokens):
            tok_B, logp_B = sample_tokens(logits_B_V, params, self.generator)
            for row, (seq, t, lp) in enumerate(zip(live, tok_B.tolist(), logp_B.tolist(), strict=True)):
                if reasons[seq] is not None:
                    continue
                tokens[seq].append(t)
                logps[seq].append(lp)
                if t in self.eos_ids or (stop_window and self._hit_stop(tokens[seq], params.stop, stop_window)):
                    reasons[seq] = StopReason.STOP
                    done_in_batch += 1
            if step == max_tokens - 1 or done_in_batch == len(live):
                break
            if done_in_batch >= max(1, int(self.compact_fraction * len(live))):
                keep = [r for r, seq in enumerate(live) if reasons[seq] is None]
                keep_t = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(keep_t)
                tok_B, mask_B_L, next_pos_B = tok_B[keep_t], mask_B_L[keep_t], next_pos_B[keep_t]
                live = [live[r] for r in keep]
                done_in_batch = 0
                padded = not bool(mask_B_L.all())
            if not paged:  # (a paged cache knows each row's length)
                mask_B_L = torch.cat([mask_B_L, mask_B_L.new_ones((len(live), 1))], dim=1)
            logits_B_V = self._step(tok_B, next_pos_B, mask_B_L if padded else None, cache)
            if routes is not None:  # the routing of the token each live row just read
                for seq, r_R in zip(live, self._routing.take(), strict=True):
                    routes[seq].append(r_R)
            next_pos_B = next_pos_B + 1
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        out = [self._completion(tokens[i], logps[i], reasons[i], texts[i], params) for i in range(total)]
        if routes is None:
            return out
        return [replace(c, routes=fit_routes(concat_routes(r), len(prompts[i // n]) + len(c.token_ids)))
                for i, (c, r) in enumerate(zip(out, routes, strict=True))]

    def _prompt_routes(self, prompts: list[list[int]], n: int) -> list[list[torch.Tensor]]:
        """Each of the `n` rows per prompt starts with its prompt's routing from the (left-padded) prefill."""
        return [[r] for r in prompt_routes(self._routing.take(), prompts) for _ in range(n)]

    def _step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, mask_B_K: torch.Tensor | None, cache) -> torch.Tensor:
        """One decode step: each row's next-token logits `[B, V]`; `mask_B_K` (None: no padding) covers the cached
        keys and the new one."""
        if isinstance(cache, PagedKV):  # one CUDA graph per batch-size bucket, or the eager step
            if self._buckets is not None:
                return self._buckets.step(tok_B, pos_B, cache)
            return self._fast.step(tok_B, pos_B, None, cache)
        if self._graphed is not None and isinstance(cache, StaticKV):
            return self._graphed.step(tok_B, pos_B, None if mask_B_K is None else mask_B_K.bool(), cache)
        if self._fast is not None and (isinstance(cache, StaticKV) or not has_forward_hooks(self.model)):
            return self._fast.step(tok_B, pos_B, None if mask_B_K is None else mask_B_K.bool(), cache)
        out = self.model(
            input_ids=tok_B[:, None],
            attention_mask=None if mask_B_K is None else self._decode_mask(mask_B_K),
            position_ids=pos_B[:, None],
            use_cache=True,
            **{self._cache_keyword: cache},
        )
        return out.logits[:, -1, :]

    def _prefill_mask(self, mask_P_K: torch.Tensor, past: int = 0) -> torch.Tensor:
        """`prefill_allowed` as `[P, 1, L, past + L]`, ready-made for SDPA; other attention implementations
        get the 2-D key mask and build their own."""
        if getattr(self.model.config, "_attn_implementation", None) != "sdpa":
            return mask_P_K
        return prefill_allowed(mask_P_K, past)[:, None, :, :]

    def _decode_mask(self, mask_B_L: torch.Tensor) -> torch.Tensor:
        """The key-padding mask of a one-token decode step. SDPA takes it ready-made as `[B, 1, 1, L]` bool,
        which skips transformers' per-step mask construction (~10% of a small model's decode step)."""
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            return mask_B_L.bool()[:, None, None, :]
        return mask_B_L

    def _hit_stop(self, seq_tokens: list[int], stops: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(seq_tokens[-window - 1 :], skip_special_tokens=True)
        return any(s in tail for s in stops)

    @staticmethod
    def _completion(
        token_ids: list[int], logprobs: list[float], reason: StopReason | None, text: str, params: SamplingParams
    ) -> Completion:
        for s in params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return Completion(tuple(token_ids), tuple(logprobs), reason or StopReason.LENGTH, text)


