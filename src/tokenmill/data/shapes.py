"""`shapes`: a procedural task that needs the image: count the coloured shapes in a generated picture.

A picture is a `grid x grid` board of 16-pixel cells on a white ground; 1 to `grid²` cells (uniformly many)
hold a filled square or disc of a random colour, size and offset. The prompt asks how many shapes there are;
the answer is the count, checked exactly. The text is the same for every row, so the answer is in the image
only: with the image blanked (`blank=True`, or `blank_images` on existing rows) a model can do no better than
the most frequent count (chance: 1 / grid²), the control that shows a model reads the picture.

Rows are TRL's vision-language format: a conversational `prompt` with an image part, an `images` column
holding the PIL picture, `answer`, and `completion`: a demonstration for a supervised warm start from a
sloppy teacher that overlooks one shape in a `slip` share of the boards with more than one (so a model warm
started on it with `slip` > 0.5 prefers the miscount; the reward only ever checks `answer`).

    >>> ds = shapes_dataset(4, seed=0)                                                # doctest: +SKIP
    >>> shapes_reward(ds["prompt"], ds["answer"], answer=ds["answer"])                # doctest: +SKIP
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import random
from typing import Any

from tokenmill.data.images import pil

CELL = 16
QUESTION = "How many shapes?"
PALETTE = ((220, 30, 30), (30, 160, 40), (30, 60, 220), (230, 170, 20), (150, 40, 190), (20, 20, 20))


def shapes_prompt() -> list[dict[str, Any]]:
    """The one question every row asks (the picture goes in the image slot)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def draw_board(cells: list[tuple[int, int, int, int, int, int]], grid: int):
    """A picture of `cells`: (row, column, shape 0 square / 1 disc, colour index, size, offset) each."""
    Image = pil()
    from PIL import ImageDraw

    picture = Image.new("RGB", (grid * CELL, grid * CELL), (255, 255, 255))
    draw = ImageDraw.Draw(picture)
    for row, column, shape, colour, size, offset in cells:
        x, y = column * CELL + offset, row * CELL + offset
        box = (x, y, x + size - 1, y + size - 1)
        (draw.rectangle if shape == 0 else draw.ellipse)(box, fill=PALETTE[colour])
    return picture


def _board(rng: random.Random, grid: int) -> list[tuple[int, int, int, int, int, int]]:
    count = rng.randint(1, grid * grid)
    places = rng.sample([(r, c) for r in range(grid) for c in range(grid)], count)
    cells = []
    for r, c in sorted(places):
        size = rng.randint(CELL // 2, CELL - 2)
        cells.append((r, c, rng.randint(0, 1), rng.randrange(len(PALETTE)), size, rng.randint(0, CELL - size)))
    return cells


def shapes_dataset(n: int, seed: int = 0, grid: int = 2, exclude: set[str] | None = None, slip: float = 0.0,
                   blank: bool = False):
    """`n` rows of pictures with 1 to `grid²` shapes. `exclude` holds `key`s (a board's description) to skip, so
    held-out pictures never appear in training; `slip`: the share of demonstrations one short; `blank`: the
    pictures left empty (the text-only control; `answer` is still the true count)."""
    from datasets import Dataset

    rng, slip_rng = random.Random(seed), random.Random(seed + 1)
    rows: dict[str, list[Any]] = {"prompt": [], "images": [], "answer": [], "completion": [], "key": []}
    banned, attempts = set(exclude or ()), 0
    while len(rows["key"]) < n:
        cells = _board(rng, grid)
        key = ";".join(",".join(map(str, c)) for c in cells)
        attempts += 1
        if key in banned and attempts < 100 * n:
            continue
        count = len(cells)
        # the sloppy teacher overlooks one shape in `slip` of the boards with more than one
        shown = count - 1 if count > 1 and slip_rng.random() < slip else count
        rows["prompt"].append(shapes_prompt())
        rows["images"].append([draw_board([] if blank else cells, grid)])
        rows["answer"].append(str(count))
        rows["completion"].append(str(shown))
        rows["key"].append(key)
    return Dataset.from_dict(rows)


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # a conversational completion: its assistant message
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def shapes_reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is exactly the count (surrounding whitespace ignored), else 0.0."""
    return [1.0 if _text(c).strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def blank_images(rows, grid: int = 2):
    """The rows with every picture replaced by an empty board (the control: the answer is then not in the input)."""
    empty = draw_board([], grid)
    return rows.map(lambda row: {"images": [empty for _ in row["images"]]})


def shapes_preferences(n: int, seed: int = 0, grid: int = 2, exclude: set[str] | None = None):
    """`n` preference pairs in TRL's vision format: a board in `images`, the conversational `prompt`, the true
    count `chosen` over a miscount (one more or one less) `rejected`, both as assistant messages."""
    rows = shapes_dataset(n, seed=seed, grid=grid, exclude=exclude).remove_columns(["completion"])
    rng = random.Random(seed + 2)
    said: dict[str, list[Any]] = {"chosen": [], "rejected": []}
    for answer in rows["answer"]:
        count = int(answer)
        wrong = count - 1 if count == grid * grid or (count > 1 and rng.random() < 0.5) else count + 1
        for key, k in (("chosen", count), ("rejected", wrong)):
            said[key].append([{"role": "assistant", "content": [{"type": "text", "text": str(k)}]}])
    return rows.add_column("chosen", said["chosen"]).add_column("rejected", said["rejected"])
