"""Vision-language models in process: the processor that turns messages and images into token ids and pixel
values, and an engine that samples from a Qwen2-VL-family model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

`VisionProcessor` is the model's own tokenizer (its chat template renders an image part as the model's image
markers) plus its image processor (`preprocessor_config.json`, read with `AutoImageProcessor`): each image
placeholder token is repeated once per image token the merger makes (`grid t x h x w / merge_size²`), as the
model's `Processor` class does. It needs neither torchvision nor the video processor.

`VisionEngine` decodes group by group: a prompt's images go through the vision encoder once, in the prompt's
prefill, and the group's `n` samples continue from copies of that one key/value cache. Positions are the
model's multimodal rotary positions (`get_rope_index`): 3 per token, the image tokens laid out on their grid,
the text after them continuing from the largest (Qwen3-VL interleaves the three axes in the rotary frequencies
and its own `get_rope_index` lays them out); the trainer computes the same ones (`training.vision`), so the
sampler's logprobs equal the trainer's. Qwen3-VL's deepstack features (intermediate vision-tower layers added
to the image slots' hidden states in the first language layers) are computed with the prompt's image features
and fed in the same prefill (`deepstack_inputs`); decoded tokens are text and take none.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.sampling import sample_tokens
from tokenmill.types import Completion, ImageInputs, SamplingParams, StopReason


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config of a vision-language config (the config itself for a text model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder (with its merger) of a Qwen2-VL-family model, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    return getattr(inner, "visual", None)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def image_slots(model: torch.nn.Module, ids_B_T: torch.Tensor) -> torch.Tensor:
    """bool `[B, T]`: the image tokens the processor laid out (runs right after a vision-start token). An image
    token the policy sampled in a completion is text: it has no picture and is embedded as itself."""
    config = _base(model).config
    is_image_B_T = ids_B_T == config.image_token_id
    T = ids_B_T.shape[1]
    positions = torch.arange(T, device=ids_B_T.device).expand(ids_B_T.shape)
    last_other_B_T = torch.where(is_image_B_T, -1, positions).cummax(dim=1).values  # the run's opener
    opener_B_T = ids_B_T.gather(1, last_other_B_T.clamp(min=0))
    return is_image_B_T & (last_other_B_T >= 0) & (opener_B_T == config.vision_start_token_id)


def rope_positions(model: torch.nn.Module, ids_B_T: torch.Tensor, image_grid_thw: torch.Tensor | None,
                   mask_B_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids `[3, B, T]`, each row's delta `[B, 1]`: its next position minus its length). Text-only rows
    get 1-D positions repeated on the three axes."""
    if image_grid_thw is None:
        pos_B_T = torch.arange(ids_B_T.shape[1], device=ids_B_T.device).expand(ids_B_T.shape)
        return pos_B_T[None].expand(3, -1, -1), torch.zeros((ids_B_T.shape[0], 1), dtype=torch.long)
    kinds_B_T = image_slots(model, ids_B_T).int()
    if mask_B_T is not None:
        kinds_B_T = kinds_B_T * mask_B_T.int()
    return _base(model).model.get_rope_index(ids_B_T, kinds_B_T, image_grid_thw.to(ids_B_T.device),
                                             attention_mask=mask_B_T)


def backbone(model: torch.nn.Module, ids_B_T: torch.Tensor, pixel_values: torch.Tensor | None,
             image_grid_thw: torch.Tensor | None, position_ids: torch.Tensor, **kwargs: Any):
    """The language model's output over token embeddings whose image slots (`image_slots`) hold the vision
    encoder's features of `pixel_values`, in order. `kwargs`: the cache and `use_cache`."""
    inner = _base(model).model
    embeds_B_T_H = inner.get_input_embeddings()(ids_B_T)
    if pixel_values is not None:
        grid = image_grid_thw.to(ids_B_T.device)
        encoded = inner.get_image_features(pixel_values.to(ids_B_T.device), grid, return_dict=True)
        features_N_H = torch.cat(list(encoded.pooler_output)).to(embeds_B_T_H.dtype)
        slots_B_T = image_slots(model, ids_B_T)
        if int(slots_B_T.sum()) != features_N_H.shape[0]:
            raise ValueError(f"{int(slots_B_T.sum())} image tokens for {features_N_H.shape[0]} image features")
        embeds_B_T_H = embeds_B_T_H.masked_scatter(slots_B_T[..., None], features_N_H)
        kwargs.update(deepstack_inputs(encoded, slots_B_T))
    return inner.language_model(inputs_embeds=embeds_B_T_H, position_ids=position_ids, **kwargs)


def deepstack_inputs(encoded: Any, slots_B_T: torch.Tensor) -> dict[str, Any]:
    """Qwen3-VL's deepstack keywords for its language model: the vision tower's intermediate features (one
    tensor `[N, H]` per fed layer, images in order) added to the image slots' hidden states after the first
    layers. Empty for a family without them (Qwen2-VL, Qwen2.5-VL)."""
    levels = getattr(encoded, "deepstack_features", None)
    if not levels:
        return {}
    return {"visual_pos_masks": slots_B_T, "deepstack_visual_embeds": [torch.cat(list(level)) for level in levels]}


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The ids that end a completion: the generation config's end-of-sequence id(s) and the tokenizer's."""
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    listed = config_eos if isinstance(config_eos, list) else [config_eos]
    return {int(e) for e in (*listed, tokenizer.eos_token_id) if e is not None}


class VisionProcessor:
    """Messages with image parts plus PIL images -> (token ids, `ImageInputs`), for Qwen2-VL-family models."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str,
                 vision_start: str = "<|vision_start|>") -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.vision_start_id = tokenizer.convert_tokens_to_ids(vision_start)
        self.merge = int(getattr(image_processor, "merge_size", 2))

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Any = None, config: Any = None) -> VisionProcessor:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = config or AutoConfig.from_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        vision_start = tokenizer.convert_ids_to_tokens(config.vision_start_token_id)
        return cls(tokenizer, AutoImageProcessor.from_pretrained(path), image_token, vision_start)

    def pixels(self, images: Sequence[Any], sources: tuple[str, ...] = ()) -> ImageInputs:
        """The images as the vision encoder reads them."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(out["pixel_values"], out["image_grid_thw"].long(), tuple(sources), tuple(images))

    def render(self, messages: Sequence[dict], inputs: ImageInputs | None, generation_prompt: bool = True) -> str:
        """The chat template's text with each image's placeholder repeated once per image token."""
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        pieces = text.split(self.image_token)
        counts = [] if inputs is None else (inputs.image_grid_thw.prod(-1) // self.merge**2).tolist()
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the prompt has {len(pieces) - 1} image slots for {len(counts)} images")
        return pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:], strict=True))

    def encode(self, messages: Sequence[dict], images: Sequence[Any], sources: tuple[str, ...] = (),
               generation_prompt: bool = True) -> tuple[list[int], ImageInputs | None]:
        """(token ids of the rendered prompt, its `ImageInputs` or None without images)."""
        inputs = self.pixels(images, sources) if images else None
        text = self.render(messages, inputs, generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), inputs


class VisionEngine:
    """In-process engine over a Qwen2-VL-family model (which may be the trainer's own module). `generate`
    takes each prompt's `ImageInputs` (None for a text-only prompt) beside its token ids."""

    takes_images = True  # `rollout.generator.build_generator` gives it a generator that reads images

    def __init__(self, model, tokenizer, *, seed: int = 0, autocast_dtype: torch.dtype | None = None) -> None:
        self.model, self.tokenizer, self.autocast_dtype = model, tokenizer, autocast_dtype
        self.device = next(model.parameters()).device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self.prefix_cache = None  # (HFEngine.update_weights clears one where there is one)
        self.max_positions = getattr(text_config(model.config), "max_position_embeddings", None)
        forward = inspect.signature(_base(model).forward).parameters
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"
        self.encoder_calls = 0  # prompts whose images went through the vision encoder (one per group)

    # the same in-place weight copy and sampling-RNG state as the text engine's
    update_weights = HFEngine.update_weights
    state_dict = HFEngine.state_dict
    load_state_dict = HFEngine.load_state_dict

    def close(self) -> None:
        """Nothing to release (the module belongs to the caller)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: Sequence[ImageInputs | None] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt; `images[i]`: prompt i's images (its image tokens are in the ids)."""
        images = list(images) if images is not None else [getattr(p, "images", None) for p in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self._autocast():
                return [self._decode(list(p), params, inputs) for p, inputs in zip(prompts, images, strict=True)]
        finally:
            self.model.train(was_training)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _prefill(self, prompt: list[int], inputs: ImageInputs | None, n: int):
        """The last position's logits repeated `n` times, the cache of the prompt (images encoded here, once)
        repeated `n` times, and the next token's position."""
        ids_1_L = torch.tensor([prompt], dtype=torch.long, device=self.device)
        grid = None if inputs is None else inputs.image_grid_thw.to(self.device)
        pos_3_1_L, delta_1_1 = rope_positions(self.model, ids_1_L, grid)
        pixels = None
        if inputs is not None:
            pixels = inputs.pixel_values
            self.encoder_calls += 1
        cache = DynamicCache(config=text_config(self.model.config))
        hidden_1_L_H = backbone(self.model, ids_1_L, pixels, grid, pos_3_1_L, use_cache=True,
                                **{self._cache_keyword: cache}).last_hidden_state
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits_1_V = _base(self.model).lm_head(hidden_1_L_H[:, -1, :])
        return logits_1_V.repeat_interleave(n, 0), cache, len(prompt) + int(delta_1_1[0, 0])

    def _decode(self, prompt: list[int], params: SamplingParams, inputs: ImageInputs | None) -> list[Completion]:
        n = params.n
        logits_B_V, cache, next_pos = self._prefill(prompt, inputs, n)
        max_tokens = params.max_tokens
        if self.max_positions:
            max_tokens = max(1, min(max_tokens, self.max_positions - len(prompt)))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[StopReason | None] = [None] * n
        live = list(range(n))  # batch row -> sample index
        for step in range(max_tokens):
            tok_B, logp_B = sample_tokens(logits_B_V, params, self.generator)
            for seq, t, lp in zip(live, tok_B.tolist(), logp_B.tolist(), strict=True):
                tokens[seq].append(t)
                logps[seq].append(lp)
                if t in self.eos_ids or self._hit_stop(tokens[seq], params.stop):
                    reasons[seq] = StopReason.STOP
            keep = [r for r, seq in enumerate(live) if reasons[seq] is None]
            if not keep or step == max_tokens - 1:
                break
            if len(keep) < len(live):
                keep_t = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(keep_t)
                tok_B, live = tok_B[keep_t], [live[r] for r in keep]
            pos_3_B_1 = torch.full((3, len(live), 1), next_pos + step, dtype=torch.long, device=self.device)
            out = self.model(input_ids=tok_B[:, None], position_ids=pos_3_B_1, use_cache=True,
                             **{self._cache_keyword: cache})
            logits_B_V = out.logits[:, -1, :]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return [self._completion(tokens[i], logps[i], reasons[i], texts[i], params.stop) for i in range(n)]

    def _hit_stop(self, seq_tokens: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        window = max(len(s) for s in stops)
        tail = self.tokenizer.decode(seq_tokens[-window - 1:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    @staticmethod
    def _completion(ids: list[int], logprobs: list[float], reason: StopReason | None, text: str,
                    stops: tuple[str, ...]) -> Completion:
        for s in stops:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return Completion(tuple(ids), tuple(logprobs), reason or StopReason.LENGTH, text)
