"""The `shapes` task: the count is in the picture only; the blanked control removes it."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")


def _count_shapes(picture) -> int:
    """Cells of the 2 x 2 board holding any non-white pixel."""
    pixels = picture.load()
    cells = set()
    for x in range(picture.width):
        for y in range(picture.height):
            if pixels[x, y] != (255, 255, 255):
                cells.add((x // 16, y // 16))
    return len(cells)


def test_the_answer_is_the_number_of_shapes_drawn():
    from tokenmill.data.shapes import QUESTION, shapes_dataset, shapes_reward

    rows = shapes_dataset(40, seed=3)
    assert {str(_count_shapes(r["images"][0])) for r in rows} == {"1", "2", "3", "4"}
    assert all(str(_count_shapes(r["images"][0])) == r["answer"] for r in rows)
    assert all(r["prompt"][0]["content"][1]["text"] == QUESTION for r in rows)  # the text never tells
    assert shapes_reward(rows["prompt"], rows["answer"], answer=rows["answer"]) == [1.0] * 40
    assert shapes_reward(rows["prompt"], [[{"role": "assistant", "content": "9"}]] * 40, answer=rows["answer"]) == [0.0] * 40


def test_the_sloppy_teacher_undercounts_and_blanking_removes_the_shapes():
    from tokenmill.data.shapes import blank_images, shapes_dataset

    rows = shapes_dataset(200, seed=0, slip=0.6)
    short = [int(r["answer"]) - int(r["completion"]) for r in rows]
    assert set(short) == {0, 1}
    many = [s for s, r in zip(short, rows, strict=True) if r["answer"] != "1"]
    assert 0.5 < sum(many) / len(many) < 0.7
    assert all(_count_shapes(r["images"][0]) == 0 for r in blank_images(rows.select(range(10))))


def test_held_out_pictures_never_appear_in_training():
    from tokenmill.data.registry import task_splits

    train, held, reward = task_splits("shapes", 300, 100, seed=0)
    assert not set(train["key"]) & set(held["key"])
    assert reward.__name__ == "shapes_reward"
