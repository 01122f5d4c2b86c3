"""Prompt sources: a `datasets.Dataset` read in seeded epochs, with a position that resumes exactly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tokenmill.types import ConfigError


def load_rows(path: str, split: str = "train", field: str = "data.path"):
    """A local json/jsonl/csv/parquet file, a `save_to_disk` folder, or a `datasets` hub name (errors name
    `field`)."""
    import datasets

    p = Path(path)
    if p.is_file():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(p.suffix)
        if kind is None:
            raise ConfigError(f"{field}: unsupported file type {p.suffix!r} (json, jsonl, csv, parquet)")
        try:
            return datasets.load_dataset(kind, data_files=str(p), split="train")
        except Exception as exc:  # noqa: BLE001 - a broken row deep in the file: one line, not a traceback
            cause = exc.__cause__ or exc
            raise ConfigError(f"{field}: cannot read {path!r}: {type(cause).__name__}: {str(cause)[:200]}") from None
    if p.is_dir() and (p / "dataset_info.json").exists():
        return datasets.load_from_disk(str(p))
    if p.is_dir() and (p / split / "dataset_info.json").exists():
        return datasets.load_from_disk(str(p / split))
    return datasets.load_dataset(path, split=split)


def split_held_out(rows, n: int, seed: int = 0, field: str = "data.num_eval"):
    """(training rows, `n` held-out rows): a seeded draw of `n` rows, the rest kept in their order. `rows` is a
    `datasets.Dataset` or a list of row dicts; at least one row must be left to train on."""
    if n <= 0:
        return rows, None
    if n >= len(rows):
        raise ConfigError(f"{field}: {n} held-out rows leave none of the dataset's {len(rows)} to train on")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = sorted(order[:n])
    kept = sorted(order[n:])
    if hasattr(rows, "select"):  # a datasets.Dataset
        return rows.select(kept), rows.select(held)
    return [rows[i] for i in kept], [rows[i] for i in held]


class PromptSource:
    """Hands out rows `k` at a time; each epoch is a fresh permutation seeded by (seed, epoch)."""

    def __init__(self, dataset, seed: int = 0, shuffle: bool = True) -> None:
        if len(dataset) == 0:
            raise ConfigError("data: the training set is empty")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_rows(self, k: int) -> list[dict[str, Any]]:
        picked: list[int] = []
        while len(picked) < k:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation()
            take = min(k - len(picked), len(self._order) - self.index)
            picked.extend(self._order[self.index : self.index + take])
            self.index += take
        if hasattr(self.dataset, "column_names"):  # a datasets.Dataset: one columnar read, not k row reads
            columns = self.dataset[picked]
            return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        return [self.dataset[i] for i in picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, self.index = int(state["epoch"]), int(state["index"])
        if epoch != self.epoch:  # an async trainer sets the position every step: shuffle only for a new epoch
            self.epoch = epoch
            self._order = self._permutation()
