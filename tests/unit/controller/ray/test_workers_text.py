"""The text a trainer rank's failure is reported with (the restart message, events.jsonl) is cut at a space,
never inside a word."""

from __future__ import annotations

from tokenmill.controller.ray.workers import clip

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:16539: Connection "
        "reset by peer. This may indicate a possible application crash on rank 1 or a network set up issue.")


def test_a_long_error_is_cut_between_words():
    cut = clip(GLOO, 120)
    assert len(cut) <= 120 and cut.endswith(" ...")
    kept = cut.removesuffix(" ...")
    assert GLOO.startswith(kept) and GLOO[len(kept)] == " "  # the next character was a space: no word cut
    assert clip(GLOO, 1000) == GLOO  # short enough: as it was
    assert clip("x" * 50, 20) == "x" * 16 + " ..."  # one long word: cut, and marked
