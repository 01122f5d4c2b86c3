"""SFT, preference and reward-model runs from their configs: the data read and its columns checked, the model
loaded, the run logged into its output folder, the trained model written and, for a built-in preference task,
the held-out numbers. `tokenmill.sft` / `preference` / `reward_model` (and `tokenmill sft | preference`) call
these; the steps themselves are `training.offline.run_offline`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tokenmill.checkpoint.lock import lock_run_folder
from tokenmill.config.offline import OfflineConfig, PreferenceConfig, SFTConfig
from tokenmill.config.preflight import check_model_and_data
from tokenmill.data.formats import pair_problem, sft_columns
from tokenmill.tracking import MetricsLogger
from tokenmill.training.dist import is_main
from tokenmill.training.model import load_policy, resolve_device
from tokenmill.types import ConfigError


@contextlib.contextmanager
def offline_logger(cfg: OfflineConfig, label: str) -> Iterator[MetricsLogger | None]:
    """The run logger of an offline run (the main rank's; None on the others): the same metrics.jsonl and
    events.jsonl rows as an RL run, in its output_dir, with a line every tenth of it. The main rank holds the
    folder's lock meanwhile (`checkpoint.lock`): a second run writing there is refused."""
    lock = lock_run_folder(cfg.output_dir).adopt() if is_main() else None
    logger = None
    try:
        logger = MetricsLogger(cfg.output_dir, cfg.steps, console="plain", log_every=max(1, cfg.steps // 10),
                               run_config=cfg.model_dump(mode="json"), label=label) if is_main() else None
        yield logger
    finally:
        if logger is not None:
            logger.close()
        if lock is not None:
            lock.release()


def sft_rows(cfg: SFTConfig):
    """The rows an SFT run trains on (a built-in task's or a dataset's) and the columns it reads in them (the
    dataset's TRL format: `data.formats.sft_columns`)."""
    from tokenmill.data import load_rows
    from tokenmill.data.registry import task_splits

    check_model_and_data(cfg.model, cfg.data.path, cfg.data.split)
    if cfg.data.task:
        rows, _, _ = task_splits(cfg.data.task, cfg.data.num_train, cfg.data.held_out_rows, seed=cfg.seed,
                                 **cfg.data.task_kwargs)
    else:
        rows = load_rows(cfg.data.path, cfg.data.split)
    return rows, sft_columns(rows.column_names, cfg.data.prompt_column, cfg.completion_column, cfg.messages_column)


def run_sft_config(cfg: SFTConfig) -> dict[str, Any]:
    """Train and write the SFT model `cfg` describes; {"losses": per step, "output_dir": ...}."""
    from tokenmill.training.sft import run_sft

    rows, columns = sft_rows(cfg)
    model, tok = load_policy(cfg.model, resolve_device(cfg.model.device))
    samples = image_sft_rows(cfg, model, tok, rows, columns)
    with offline_logger(cfg, "SFT") as logger:
        losses = run_sft(model, tok, rows, samples=samples, steps=cfg.steps, batch_size=cfg.batch_size,
                         prompt_column=columns.get("prompt", "prompt"),
                         completion_column=columns.get("completion", "completion"),
                         messages_column=columns.get("messages"), text_column=columns.get("text"), packing=cfg.packing,
                         micro_batch_tokens=cfg.micro_batch_tokens, output_dir=cfg.output_dir,
                         log_every=max(1, cfg.steps // 10), logger=logger, **cfg.optimiser())
    return {"losses": losses, "output_dir": cfg.output_dir}


def image_sft_rows(cfg: SFTConfig, model, tok, rows, columns: dict[str, str]):
    """A vision-language policy's SFT samples with their images when the rows have some (the first row tells),
    else None (the rows are read as text): prompt / completion rows (`training.vision.image_sft_samples`),
    conversations or conversational completions (`training.vision_roles.image_chat_samples`)."""
    from tokenmill.data.images import ImagePolicy, has_images
    from tokenmill.engines.local.vision import VisionProcessor, is_vision_config

    column = columns.get("messages") or columns.get("prompt") or columns.get("text", "text")
    if not len(rows) or not has_images(rows[0], column, cfg.data.image_column):
        return None
    if not is_vision_config(model.config):
        raise ConfigError(f"model.path: the rows have images (data.image_column {cfg.data.image_column!r} or "
                          f"image parts) but {cfg.model.path!r} is a text model; use a vision-language model")
    if "text" in columns:
        raise ConfigError("data: SFT with images takes prompt / completion rows or conversations (TRL's formats "
                          "with an images column); plain text with images is not read")
    from tokenmill.training.vision import image_sft_samples
    from tokenmill.training.vision_roles import image_chat_samples

    processor = VisionProcessor.from_pretrained(cfg.model.path, tokenizer=tok)
    policy = ImagePolicy.from_config(cfg.data)
    completion = columns.get("completion")
    if completion is not None and isinstance(rows[0][completion], str):
        return image_sft_samples(processor, rows, column, completion, cfg.data.image_column, policy)
    return image_chat_samples(processor, rows, column, cfg.data.image_column, policy, completion_column=completion)


def pair_images(cfg: PreferenceConfig, model, tok):
    """How a vision-language policy reads the pairs' images (`training.vision_roles.PairImages`); None for a
    text model."""
    from tokenmill.engines.local.vision import VisionProcessor, is_vision_config
    from tokenmill.training.vision_roles import PairImages

    if not is_vision_config(model.config):
        return None
    return PairImages(VisionProcessor.from_pretrained(cfg.model.path, tokenizer=tok), cfg.data.image_column)


def preference_pairs(cfg: PreferenceConfig):
    """(training pairs, held-out pairs or None): a built-in task's (the held-out ones disjoint, seeded apart)
    or a dataset's, with the prompt / chosen / rejected columns checked."""
    from tokenmill.data import load_rows
    from tokenmill.data.registry import HELD_OUT_SEED_OFFSET
    from tokenmill.data.tasks import addition_preferences

    check_model_and_data(cfg.model, cfg.data.path, cfg.data.split)
    held = None
    if cfg.data.task:
        held_seed = cfg.seed + HELD_OUT_SEED_OFFSET
        held = addition_preferences(cfg.data.num_eval, seed=held_seed) if cfg.data.num_eval else None
        rows = addition_preferences(cfg.data.num_train, seed=cfg.seed, exclude=set(held["prompt"]) if held else None)
    else:
        rows = load_rows(cfg.data.path, cfg.data.split)
    problem = pair_problem(rows.column_names)
    if problem:
        raise ConfigError(problem)
    return rows, held


def run_preference_config(cfg: PreferenceConfig) -> dict[str, Any]:
    """Train and write the DPO / IPO / SimPO policy or reward model `cfg` describes; {"objective", "losses",
    "output_dir", and with held-out pairs "heldout_margin" and "heldout_chosen_preferred" (DPO family) or
    "heldout_pairwise_accuracy" (reward model)}."""
    from tokenmill.training import preference as pref

    rows, held = preference_pairs(cfg)
    device = resolve_device(cfg.model.device)
    common = {"steps": cfg.steps, "batch_size": cfg.batch_size, "output_dir": cfg.output_dir, **cfg.optimiser()}
    if cfg.objective == "reward_model":
        model, tok = pref.load_reward_model_for_training(cfg.model.path, seed=cfg.seed, lora=cfg.model.lora,
                                                         device=device)
        with offline_logger(cfg, "RM") as logger:
            losses = pref.run_reward_model(model, tok, rows, **common, logger=logger)
        report = {"pairwise_accuracy": pref.pairwise_accuracy(model, tok, held)} if held else {}
    else:
        model, tok = load_policy(cfg.model, device)
        reference = pref.frozen_reference(model)  # None with LoRA: the adapters switched off are the reference
        images = pair_images(cfg, model, tok)
        with offline_logger(cfg, cfg.objective.upper()) as logger:
            losses = pref.run_dpo(model, tok, rows, loss=cfg.objective, beta=cfg.beta, **common, logger=logger,
                                  images=images)
        report = pref.implicit_margin(model, reference, tok, held, images=images) if held else {}
    return {"objective": cfg.objective, "losses": losses, "output_dir": cfg.output_dir,
            **{f"heldout_{k}": v for k, v in report.items()}}
