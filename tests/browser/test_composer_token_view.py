"""Item 1's token-level view of a run's own samples: a real one-step run writes samples.jsonl with each
completion's tokens and sampled logprobs, and Inspect shows the completion token by token, shaded by them."""

from __future__ import annotations

import json

import pytest
import torch

import tokenmill

expect = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)").expect


def _one_step_run(folder, model: str) -> list[dict]:
    torch.set_num_threads(1)
    tokenmill.train({
        "model": {"path": model}, "data": {"task": "addition", "num_train": 20, "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 5}, "training": {"seed": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(folder), "console": "none", "log_samples": 4},
        "checkpoint": {"save_final": False},
    })
    (folder / "composer.json").write_text(json.dumps({"mode": "rl", "started": 1.7e9, "pid": None, "total_steps": 1}))
    (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0, "ended": 1.7e9 + 9}))
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def test_inspect_shows_a_logged_completion_token_by_token_shaded_by_logprob(page, composer, tiny_model_path, shots):
    _, _, runs_dir = composer
    records = _one_step_run(runs_dir / "tokens", tiny_model_path)
    page.get_by_test_id("nav-runs").click()
    page.get_by_test_id("run-open-tokens").click()
    page.get_by_test_id("samples-step").select_option("1")
    views = page.get_by_test_id("step-view").get_by_test_id("sample-tokens")
    expect(views).to_have_count(len(records))
    for view, record in zip(views.all(), records, strict=True):
        tokens = view.locator(".tok")
        expect(tokens).to_have_count(len(record["tokens"]))
        assert tokens.all_text_contents() == [t for t, _ in record["tokens"]]
        shown = tokens.evaluate_all("els => els.map(e => [Number(e.dataset.logprob), getComputedStyle(e).backgroundColor])")
        assert [lp for lp, _ in shown] == pytest.approx([lp for _, lp in record["tokens"]], abs=1e-9)
        for lp, colour in shown:  # amber, as deep as the token was unlikely: alpha 0.7 * (1 - p)
            alpha = float(colour.rstrip(")").split(",")[-1])
            assert colour.startswith("rgba(245, 158, 11") and alpha == pytest.approx(0.7 * (1 - torch.tensor(lp).exp().item()),
                                                                                     abs=5e-3)  # 8-bit alpha
    for width, name in ((1280, "inspect-tokens"), (390, "inspect-tokens-phone")):
        page.set_viewport_size({"width": width, "height": 844})
        page.get_by_test_id("step-view").scroll_into_view_if_needed()
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        page.get_by_test_id("step-view").screenshot(path=str(shots / f"{name}.png"))
    assert page.problems == [], page.problems
