"""The other models of a run over a vision-language policy, seeing the pictures the policy sees: PPO's critic,
a distillation teacher, and the pairs of preference training.

All of them read a row's images the way the policy's trainer does (`image_hidden_states`: the same pixel
values, image slots and multimodal rotary positions as `training.vision`, from the pieces the engine shares,
`engines.local.vision.rope_positions` and `backbone`), so a critic's value, a teacher's logprob and a DPO
sequence logprob are of the prompt with its pictures, not of its text alone.

- `VisionValueModel`: the critic of a Qwen2-VL-family policy, its backbone (vision tower, merger, language
  model) with a scalar head `score` where the policy has its LM head (`training.critic.load_critic` builds it
  for a vision-language `model.path`).
- `VisionScorer`: the engines' `Scorer` over a vision-language teacher in this process; a sequence carries its
  prompt's images beside its ids (`scored_tokens`), so routing and mixing teachers work unchanged.
- `PairImages`: TRL's vision preference rows (an `images` column beside prompt / chosen / rejected) as the
  chosen and rejected samples, each with its prompt's `ImageInputs` (`training.preference`).
- `image_chat_samples`: TRL's vision conversations (`messages` with image parts) as SFT samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tokenmill.engines.local.scoring import check_score_request
from tokenmill.engines.local.vision import backbone, is_vision_config, rope_positions, text_config
from tokenmill.rollout.vision import ImagePrompt
from tokenmill.training.sharded import root_forward
from tokenmill.training.vision import LANGUAGE_LORA_TARGETS, batch_images, freeze_vision_tower
from tokenmill.types import ConfigError, ImageInputs, PromptLogprobs, Sample


class ImageRows(NamedTuple):
    """Right-padded rows with their images, as a `training.batch.Batch` holds them."""

    input_ids_B_T: torch.Tensor
    lengths_B: torch.Tensor
    images_B: tuple  # each row's `ImageInputs`, or None for a text-only row


def image_hidden_states(model: torch.nn.Module, rows: Any,
                        autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The backbone's last hidden states `[B, T, H]` of right-padded `rows` with images (a `Batch` or
    `ImageRows`): every row's pictures in row order at its image slots, the multimodal positions of its real
    tokens, as the policy's trainer reads them."""
    ids_B_T = rows.input_ids_B_T
    T, device = ids_B_T.shape[1], ids_B_T.device
    real_B_T = torch.arange(T, device=device)[None, :] < rows.lengths_B.to(device)[:, None]
    pixels, grid = batch_images(rows)
    pos_3_B_T, _ = rope_positions(model, ids_B_T, grid, real_B_T.long())
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return root_forward(model, backbone, model, ids_B_T, pixels, grid, pos_3_B_T,
                            use_cache=False).last_hidden_state


class VisionValueModel(torch.nn.Module):
    """A vision-language model's backbone with a one-output linear head: `forward(...).logits` is `[B, T, 1]`,
    as `AutoModelForTokenClassification`'s. `model` is the policy's inner `Qwen2_5_VLModel` (or Qwen2-VL's),
    so `image_hidden_states` reads it as it reads the policy."""

    base_model_prefix = "model"  # what peft reads of a transformers model

    def __init__(self, vlm: torch.nn.Module) -> None:
        super().__init__()
        self.config = vlm.config
        self.model = vlm.model
        self.score = torch.nn.Linear(text_config(vlm.config).hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, **kwargs: Any):
        from transformers.modeling_outputs import TokenClassifierOutput

        kwargs.pop("use_cache", None)
        out = self.model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                         use_cache=False, **kwargs)
        return TokenClassifierOutput(logits=self.score(out.last_hidden_state))


def load_vision_critic(path: str, cfg: Any, freeze_vision: bool = True) -> torch.nn.Module:
    """The critic of a vision-language policy: the model at `path` with a zeroed value head, its vision tower
    frozen unless `freeze_vision` is false; with `cfg.lora.rank > 0` adapters on the language model and the
    head train ('all-linear' means the language model's projections, as for the policy)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.training.lora import add_lora

    try:
        vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        field = "critic.path" if cfg.path else "model.path"
        raise ConfigError(f"{field}: cannot load a value model from {path!r}: {exc}") from None
    model = VisionValueModel(vlm)
    with torch.no_grad():
        for p in model.score.parameters():
            p.zero_()
    freeze_vision_tower(model, freeze_vision)
    if cfg.lora.rank > 0:
        lora = cfg.lora
        if lora.target_modules == "all-linear":
            lora = lora.model_copy(update={"target_modules": LANGUAGE_LORA_TARGETS})
        model = add_lora(model, lora, task_type="TOKEN_CLS", field="critic.lora")
        if not freeze_vision:
            freeze_vision_tower(model, False)
    return model


def image_values(critic: torch.nn.Module, micro: Any, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The critic's `V_t` `[B, T]` of a micro-batch with images (read before token t; 0 at t = 0)."""
    hidden_B_T_H = image_hidden_states(critic, micro, autocast_dtype)
    device = hidden_B_T_H.device
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out_B_T = critic.score(hidden_B_T_H)[..., 0].float()
    return torch.nn.functional.pad(out_B_T[:, :-1], (1, 0))


def packed_image_values(critic: torch.nn.Module, micro: Any, packed: Any,
                        autocast_dtype: torch.dtype | None) -> torch.Tensor | None:
    """The critic's head output `[R, L]` over `micro` run as its packed rows `packed` (`training.packing.
    micro_packs`), each column with its sample token's positions and pictures as the policy's packed rows
    (`training.vision.packed_hidden_states`); None where the micro-batch cannot be packed."""
    from tokenmill.training.vision import packed_hidden_states

    hidden_R_L_H = packed_hidden_states(critic, micro, packed, autocast_dtype)
    if hidden_R_L_H is None:
        return None
    device = hidden_R_L_H.device
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return critic.score(hidden_R_L_H)[..., 0].float()


def scored_tokens(sample: Sample) -> list[int]:
    """A sample's tokens as a teacher scores them: with its prompt's images beside them where it has any."""
    if sample.images is None:
        return list(sample.tokens)
    seq = ImagePrompt(sample.tokens)
    seq.images = sample.images
    return seq


def load_teacher_model(path: str, field: str, student: torch.nn.Module | None) -> torch.nn.Module:
    """A distillation teacher's model at `path` (fp32): a causal LM, or a vision-language model (its own
    class); a vision-language policy needs a vision-language teacher (it reads the same pictures)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        vision = is_vision_config(AutoConfig.from_pretrained(path))
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
            path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: cannot load {path!r}: {exc}") from None
    if student is not None and is_vision_config(student.config) and not vision:
        raise ConfigError(f"{field}: {path!r} is a text model; a vision-language policy's teacher must read the "
                          "prompts' images too (a Qwen2-VL-family model with the policy's tokenizer)")
    return model


def check_image_distillation(dist: Any, student: torch.nn.Module) -> None:
    """A vision-language policy distils from the teacher's logprob of each sampled token (`loss: sampled`, which
    `auto` means for it; `top_k: 0`): the full reverse KL and the top-k buckets read the student without its
    images, not done yet."""
    if not is_vision_config(student.config):
        return
    if dist.top_k:
        raise ConfigError("distillation.top_k: a vision-language policy is distilled on the sampled tokens' "
                          "logprobs (top_k 0); the top-k buckets with images are not done yet")
    if dist.loss == "full":
        raise ConfigError("distillation.loss: a vision-language policy is distilled with loss 'sampled' (the "
                          "teacher scores each sampled token with the images); the full reverse KL with images "
                          "is not done yet: set sampled or auto")
    if dist.self_teacher is not None or dist.teacher_tokenizer != "same":
        field = "self_teacher" if dist.self_teacher is not None else "teacher_tokenizer"
        raise ConfigError(f"distillation.{field}: a vision-language policy's teacher is a vision-language model "
                          "with the policy's tokenizer (distillation.teacher); self-distillation and "
                          "cross-tokenizer teachers do not read images yet")


class VisionScorer:
    """`Scorer` over a vision-language model in this process: each sequence's teacher-forced logprobs at
    temperature 1 with its images (`ImagePrompt.images`, None for text only), in right-padded batches of at
    most `token_budget` tokens; with `top_k`, the k most likely tokens at each position."""

    takes_images = True

    def __init__(self, model: torch.nn.Module, *, autocast_dtype: torch.dtype | None = None, pad_id: int = 0,
                 token_budget: int = 8192) -> None:
        self.model, self.autocast_dtype, self.pad_id, self.token_budget = model, autocast_dtype, pad_id, token_budget
        self.vocab = model.get_input_embeddings().weight.shape[0]
        self.max_positions = getattr(text_config(model.config), "max_position_embeddings", None)

    def close(self) -> None:
        """Nothing to release."""

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], top_k: int = 0) -> list[PromptLogprobs]:
        images = [getattr(s, "images", None) for s in sequences]
        seqs = check_score_request(list(sequences), top_k, self.vocab, self.max_positions)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[PromptLogprobs | None] = [None] * len(seqs)
        start = 0
        while start < len(order):  # the longest first: a batch is its first row's length times its rows
            end = start + 1
            while end < len(order) and len(seqs[order[start]]) * (end + 1 - start) <= self.token_budget:
                end += 1
            part = order[start:end]
            for i, scored in zip(part, self._batch([seqs[i] for i in part], [images[i] for i in part], top_k),
                                 strict=True):
                out[i] = scored
            start = end
        return out  # type: ignore[return-value]

    def _batch(self, seqs: list[list[int]], images: list[ImageInputs | None], top_k: int) -> list[PromptLogprobs]:
        device = next(self.model.parameters()).device
        lengths_B = torch.tensor([len(s) for s in seqs])
        ids_B_T = torch.full((len(seqs), int(lengths_B.max())), self.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids_B_T[b, : len(s)] = torch.tensor(s)
        self.model.eval()
        rows = ImageRows(ids_B_T.to(device), lengths_B, tuple(images))
        hidden_B_T_H = image_hidden_states(self.model, rows, self.autocast_dtype)
        head = (self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model).lm_head
        out = []
        for b, s in enumerate(seqs):
            logp_N_V = torch.log_softmax(head(hidden_B_T_H[b, : len(s) - 1]).float(), dim=-1)
            picked = logp_N_V.gather(-1, ids_B_T[b, 1 : len(s), None].to(device))[:, 0].tolist()
            tops = None
            if top_k:
                values, indices = torch.topk(logp_N_V, min(top_k, logp_N_V.shape[-1]), dim=-1)
                tops = tuple(dict(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(),
                                                                         strict=True))
            out.append(PromptLogprobs(tuple(picked), tops))
        return out


@dataclass(frozen=True)
class PairImages:
    """How preference rows' images are read (TRL's vision preference format: an `images` column beside prompt /
    chosen / rejected, or image parts in the prompt's messages): the vision-language model's processor
    (`engines.local.vision.VisionProcessor`), the rows' image column and the image policy (`data.images`)."""

    processor: Any
    image_column: str = "images"
    policy: Any = None

    def in_rows(self, rows: Sequence[dict[str, Any]]) -> bool:
        """Whether any row carries images."""
        from tokenmill.data.images import has_images

        return any(has_images(r, "prompt", self.image_column) for r in rows)

    def samples(self, rows: Sequence[dict[str, Any]]) -> list[Sample]:
        """The chosen completions as samples (in row order), then the rejected ones, each with its prompt's
        `ImageInputs`; the loss mask covers the completion and its end-of-sequence token."""
        from tokenmill.training.vision import image_sft_samples

        return [s for key in ("chosen", "rejected")
                for s in image_sft_samples(self.processor, rows, completion_column=key,
                                           image_column=self.image_column, policy=self.policy)]


def image_chat_samples(processor: Any, rows: Sequence[dict[str, Any]], messages_column: str = "messages",
                       image_column: str = "images", policy: Any = None,
                       completion_column: str | None = None) -> list[Sample]:
    """TRL's vision conversations (a `messages` column with `{"type": "image"}` parts, an `images` column beside
    it) as SFT samples trained on the assistant messages only, each with its `ImageInputs`. With
    `completion_column`, conversational prompt-completion rows: `messages_column` holds the prompt and only the
    completion's messages train. Each image placeholder is repeated once per image token, as the processor lays
    it out (`engines.local.vision.VisionProcessor.render`), and never trained."""
    from tokenmill.data.chat import chat_tokens
    from tokenmill.data.images import DEFAULT_POLICY, row_images
    from tokenmill.types import StopReason

    out = []
    for i in range(len(rows)):
        row = rows[i]
        prompt = list(row[messages_column])
        said = list(row[completion_column]) if completion_column else []
        conversation = {"messages": prompt + said, "images": row.get(image_column)}
        messages, images, sources = row_images(conversation, "messages", "images", policy or DEFAULT_POLICY,
                                               f"row {i}")
        inputs = processor.pixels(images, sources) if images else None
        ids, mask = chat_tokens(processor.tokenizer, messages, first=len(prompt) if completion_column else 0)
        ids, mask = _expanded_image_slots(processor, ids, mask, inputs)
        start = mask.index(1) if 1 in mask else len(ids)
        out.append(Sample(tokens=tuple(ids), loss_mask=tuple(mask), logprobs=(0.0,) * len(ids), prompt_len=start,
                          prompt=prompt, completion=processor.tokenizer.decode(ids[start:]),
                          stop_reason=StopReason.STOP, images=inputs))
    return out


def _expanded_image_slots(processor: Any, ids: list[int], mask: list[int],
                          inputs: ImageInputs | None) -> tuple[list[int], list[int]]:
    """Each image placeholder (an image token right after a vision-start token) repeated once per image token
    of its image, untrained; ValueError when the placeholders and the images do not pair up."""
    counts = [] if inputs is None else (inputs.image_grid_thw.prod(-1) // processor.merge**2).tolist()
    out_ids: list[int] = []
    out_mask: list[int] = []
    used = 0
    for k, (tok, m) in enumerate(zip(ids, mask, strict=True)):
        if tok == processor.image_token_id and k and ids[k - 1] == processor.vision_start_id:
            if used == len(counts):
                raise ValueError(f"the conversation has more image slots than its {len(counts)} images")
            out_ids += [tok] * counts[used]
            out_mask += [0] * counts[used]
            used += 1
        else:
            out_ids.append(tok)
            out_mask.append(m)
    if used != len(counts):
        raise ValueError(f"the conversation has {used} image slots for {len(counts)} images")
    return out_ids, out_mask
