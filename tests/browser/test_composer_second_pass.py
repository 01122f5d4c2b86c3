"""Browser tests for the Composer's second pass (issue 18): each drives the real page in chromium against the
real server and checks what the page shows against what it was given."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

expect = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)").expect


def _reward_code(i: int) -> str:
    return (f"import math\n\ndef pasted_{i}(prompts, completions, **columns):\n"
            f"    scores = [\n        math.log1p(len(c)) * {i}\n        for c in completions\n    ]\n"
            f"    return scores  # block {i}\n")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


async def _insert_blocks(url: str, chromium: str, tries: int) -> list[str]:
    """Insert `tries` blocks, each into an emptied editor; returns what went wrong. Its own async Playwright:
    a frozen renderer never answers, and only an asyncio timeout gets the test out (the sync API's waits
    hang on it)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            await page.goto(url)
            content = page.get_by_test_id("reward-editor-0").locator(".cm-content")
            for i in range(tries):
                code = _reward_code(i)
                await content.click()
                await page.keyboard.press("Control+A")
                await page.keyboard.press("Delete")
                await page.keyboard.insert_text(code)
                try:
                    shown, saved = await asyncio.wait_for(page.evaluate(
                        "[document.querySelector('[data-testid=reward-editor-0] .cm-content').innerText,"
                        " JSON.parse(localStorage.getItem('tokenmill.composer.draft.v1')).rewards[0].code]"), 10)
                except asyncio.TimeoutError:
                    return [*problems, f"the tab froze on block {i}"]
                if saved != code or _lines(shown) != _lines(code):  # innerText doubles a blank line
                    problems.append(f"block {i}: editor {shown!r}, draft {saved!r}")
            return problems
        finally:
            await browser.close()


def test_a_multi_line_block_in_one_input_event_keeps_the_editor_alive(composer, chromium_path):
    """A block of lines inserted as one input event (an IME commit, a paste; Playwright's insert_text) into an
    emptied editor: the page stays responsive and the editor and the saved draft hold exactly the block.
    (The editor used to dispatch a stale document into CodeMirror from the page's render, and the tab froze
    on about a third of the tries; eight tries catch that with probability > 0.9.)"""
    base, token, _ = composer
    out: list[list[str]] = []
    worker = threading.Thread(target=lambda: out.append(asyncio.run(
        _insert_blocks(f"{base}/?token={token}#/rewards", chromium_path, 8))), daemon=True)
    worker.start()
    worker.join(180)
    assert out == [[]], out or "no answer within 180 s"


_UNNAMED_INPUTS = """() => [...document.querySelectorAll('input, select, textarea, [contenteditable=true]')]
  .filter((el) => el.type !== 'hidden' && !el.hidden)
  .filter((el) => {
    const byAria = (el.getAttribute('aria-label') || '').trim();
    const byLabel = [...(el.labels || [])].map((l) => l.textContent.trim()).join(' ').trim();
    const byId = (el.getAttribute('aria-labelledby') || '').split(' ')
      .map((id) => (document.getElementById(id) || {}).textContent || '').join('').trim();
    return !(byAria || byLabel || byId);
  })
  .map((el) => el.outerHTML.slice(0, 160))"""


def test_every_input_has_an_accessible_name_on_every_page(page):
    """Lighthouse's label check on each page (every field of the expert level included): each input, select,
    textarea and the code editor has a name a screen reader reads, and get_by_label finds a field by its path."""
    page.get_by_test_id("preset-laptop_cpu").click()
    page.get_by_test_id("level-expert").click()
    page.get_by_test_id("field-controller.steps").wait_for()
    for name in ("compose", "rewards", "models", "watch", "runs"):
        page.get_by_test_id(f"nav-{name}").click()
        page.get_by_test_id(f"page-{name}").wait_for()
        page.wait_for_timeout(200)  # late data (schema, estimate) lays out
        assert page.evaluate(_UNNAMED_INPUTS) == [], name
    page.get_by_test_id("nav-compose").click()
    page.get_by_label("controller.steps", exact=True).fill("9")
    expect(page.get_by_test_id("field-controller.steps")).to_have_value("9")
    assert page.problems == [], page.problems


def test_the_memory_fields_refuse_what_is_not_a_positive_number(page):
    """'abc' or 0 GiB per device is named under the box and not applied (it used to become 1 silently)."""
    page.get_by_test_id("preset-laptop_cpu").click()
    page.get_by_test_id("nav-models").click()
    page.get_by_test_id("memory").wait_for()
    box = page.get_by_test_id("device-memory")
    expect(box).to_have_value("16")
    for bad in ("abc", "0", "-3"):
        box.fill(bad)
        box.press("Tab")
        expect(page.get_by_test_id("device-memory-error")).to_contain_text(f'"{bad}" is not a number above 0')
        expect(page.get_by_test_id("budget-value")).to_have_text("16 GiB")  # the estimate kept its budget
    box.fill("24")
    box.press("Tab")
    expect(page.get_by_test_id("budget-value")).to_have_text("24 GiB")
    assert page.get_by_test_id("device-memory-error").count() == 0
    devices = page.get_by_test_id("num-devices")
    devices.fill("1.5")
    devices.press("Tab")
    expect(page.get_by_test_id("num-devices-error")).to_contain_text("not a whole number above 0")
    assert page.problems == [], page.problems


def test_the_memory_page_gives_one_recommendation_in_gib(page):
    """Over budget: one recommendation (the first change that makes it fit), marked as not fitting, never a
    green box beside the warning; every size on the page in GiB."""
    page.get_by_test_id("preset-gpu_24gb").click()
    page.get_by_test_id("nav-models").click()
    page.get_by_test_id("memory").wait_for()
    with page.expect_response(lambda r: r.url.endswith("/api/estimate")) as answer:
        page.get_by_test_id("budget-slider").fill("4")
    estimate = answer.value.json()
    assert estimate["devices"][0]["fits"] is False
    rec = page.get_by_test_id("memory-recommendation")
    expect(rec).to_have_attribute("data-fits", "false")
    assert rec.count() == 1 and page.locator("[data-testid=memory] .alert.ok").count() == 0
    first = next(p for p in estimate["budget"]["proposals"] if p["fits_after"]) if any(
        p["fits_after"] for p in estimate["budget"]["proposals"]) else estimate["budget"]["proposals"][0]
    assert first["action"] in rec.inner_text()
    text = page.get_by_test_id("page-models").inner_text()
    assert " GiB" in text and not re.search(r"\dGB\b|\d GB\b", text), text
    with page.expect_response(lambda r: r.url.endswith("/api/estimate")) as answer:
        page.get_by_test_id("budget-slider").fill("80")
    assert answer.value.json()["devices"][0]["fits"] is True
    expect(rec).to_have_attribute("data-fits", "true")
    assert page.problems == [], page.problems


STARTED = 1_700_000_000.0


def _write_run(folder, config: dict, rows: list[dict], *, mode: str = "rl", seconds: float | None = 90.0,
               pid: int | None = None, started: float = STARTED) -> None:
    """A run folder as a launched run leaves it (composer.json, run.yaml, metrics.jsonl; status.json once ended)."""
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    (folder / "composer.json").write_text(json.dumps({"mode": mode, "started": started, "pid": pid,
                                                      "total_steps": len(rows)}))
    if seconds is not None:
        (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0,
                                                        "ended": started + seconds}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _append(path, row) -> None:
    with open(path, "a") as f:
        f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def _rl_rows(scale: float, n: int = 3) -> list[dict]:
    return [{"step": s, "reward/mean": scale * s, "kl": 0.01 * s, "entropy": 1.0 - 0.1 * s,
             "timing_s/generate": 1.0, "timing_s/train": 0.5} for s in range(1, n + 1)]


def _open_run(page, run_id: str) -> None:
    page.get_by_test_id("nav-runs").click()
    page.get_by_test_id(f"run-open-{run_id}").click()
    page.get_by_test_id("run-id").filter(has_text=run_id).wait_for()


def test_runs_in_nested_folders_are_named_tagged_and_compared(page, composer, shots):
    """Two runs of a sweep folder: listed with their duration, named and tagged from the page (kept in the
    folder), then compared: their reward curves overlaid on one axis and the one config key that differs."""
    _, _, runs_dir = composer
    base = {"model": {"path": "m"}, "data": {"task": "addition"}, "controller": {"steps": 3}}
    _write_run(runs_dir / "sweep" / "kl-a", {**base, "algorithm": {"kl_coef": 0.01}}, _rl_rows(1.0))
    _write_run(runs_dir / "sweep" / "kl-b", {**base, "algorithm": {"kl_coef": 0.05}}, _rl_rows(2.0), seconds=30.0)
    page.get_by_test_id("nav-runs").click()
    expect(page.get_by_test_id("run-duration-sweep/kl-a")).to_have_text("1 min 30 s")
    expect(page.get_by_test_id("run-duration-sweep/kl-b")).to_have_text("30 s")
    expect(page.get_by_test_id("run-last-sweep/kl-b")).to_have_text("6")
    with page.expect_response(lambda r: r.url.endswith("/labels")) as answer:
        page.get_by_label("name of run sweep/kl-a").fill("low kl")
        page.get_by_label("name of run sweep/kl-a").press("Tab")
    assert answer.value.status == 200, answer.value.text()
    with page.expect_response(lambda r: r.url.endswith("/labels")):
        page.get_by_label("tags of run sweep/kl-a").fill("kl baseline")
        page.get_by_label("tags of run sweep/kl-a").press("Tab")
    labels = json.loads((runs_dir / "sweep" / "kl-a" / "labels.json").read_text())
    assert labels == {"name": "low kl", "tags": ["kl", "baseline"]}
    page.get_by_label("compare run sweep/kl-a").check()
    page.get_by_label("compare run sweep/kl-b").check()
    page.get_by_test_id("compare-runs").click()
    chart = page.get_by_test_id("compare-chart-reward_mean")
    expect(chart).to_have_attribute("data-points", "3")
    legend = page.get_by_test_id("compare-chart-reward_mean-legend")
    expect(legend.locator("[data-label='low kl']")).to_have_attribute("data-value", "3")
    expect(legend.locator("[data-label='sweep/kl-b']")).to_have_attribute("data-value", "6")
    for metric in ("kl", "entropy"):
        expect(page.get_by_test_id(f"compare-chart-{metric}")).to_have_attribute("data-points", "3")
    diff = page.get_by_test_id("compare-diff").locator("tbody tr")
    assert diff.count() == 1
    assert diff.first.inner_text().split() == ["algorithm.kl_coef", "0.01", "0.05"]
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # no sideways scroll on a phone
    page.screenshot(path=str(shots / "compare-phone.png"), full_page=True)
    assert page.problems == [], page.problems


def test_sft_curves_with_axis_titles_legend_smoothing_and_zoom(page, composer):
    """An SFT run's own metrics (loss, accuracy, lr, grad_norm) are charted; a chart names its axes with the
    unit, its legend shows the last value, smoothing shows the debiased moving average, and a drag zooms."""
    _, _, runs_dir = composer
    losses = [2.0, 1.0, 1.5, 0.5]
    rows = [{"step": i + 1, "loss": v, "accuracy": 0.1 * (i + 1), "lr": 1e-5, "grad_norm": 2.0 - 0.1 * i}
            for i, v in enumerate(losses)]
    _write_run(runs_dir / "sft-run", {"model": {"path": "m"}}, rows, mode="sft")
    _open_run(page, "sft-run")
    for key in ("loss", "accuracy", "lr", "grad_norm"):
        expect(page.get_by_test_id(f"chart-{key}")).to_have_attribute("data-points", "4")
    chart = page.get_by_test_id("chart-loss")
    # uPlot draws the axis titles on its canvas; the plot's accessible name carries the same two titles
    expect(chart.locator(".chart-body")).to_have_attribute("aria-label", "loss (nats) against step")
    value = page.get_by_test_id("chart-loss-legend").locator("[data-label=loss]")
    expect(value).to_have_attribute("data-value", "0.5")
    page.get_by_test_id("smoothing").fill("0.5")
    expect(value).not_to_have_attribute("data-value", "0.5")  # the legend re-renders after the input event
    ema, weight = 0.0, 0.5
    for v in losses:
        ema = ema * weight + (1 - weight) * v
    expected = ema / (1 - weight ** len(losses))  # by hand: 0.875 / (1 - 1/16) = 0.9333...
    assert abs(expected - 0.875 / (15 / 16)) < 1e-12
    assert abs(float(value.get_attribute("data-value")) - expected) < 1e-12
    # smoothing re-created the plot (a raw series joined it): measure the new overlay once it is laid out
    overlay = chart.locator(".u-over")
    expect(overlay).to_be_visible()
    box = None
    for _ in range(50):  # the plot may be re-created once more between the check above and the measure
        box = overlay.bounding_box()
        if box is not None and box["width"] > 0:
            break
        page.wait_for_timeout(100)
    assert box is not None and box["width"] > 0, box
    page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    expect(chart).to_have_attribute("data-zoomed", "true")
    chart.locator(".u-over").dblclick()
    expect(chart).to_have_attribute("data-zoomed", "false")
    assert page.problems == [], page.problems


def test_the_bottleneck_is_judged_over_a_window_of_steps(page, composer):
    """Per step the slower stage alternates; the badge is the stage with the largest share of the last 10
    steps' time (hand-summed), not the last step's, and the share of each stage is charted per step."""
    _, _, runs_dir = composer
    rows = []
    for s in range(1, 13):
        generate, train = (1.0, 0.9) if s % 2 else (0.7, 1.0)
        rows.append({"step": s, "reward/mean": 0.1 * s, "timing_s/generate": generate, "timing_s/train": train,
                     "bottleneck": "generate" if generate > train else "train"})
    # steps 3-12 with step 12 changed below: generate 5 x 1.0 + 4 x 0.7 + 1.2 = 9.0 s, train 5 x 0.9 + 4 x 1.0 +
    # 1.0 = 9.5 s: train, while step 12's own verdict is generate
    rows[-1].update({"timing_s/generate": 1.2, "timing_s/train": 1.0, "bottleneck": "generate"})
    _write_run(runs_dir / "flippy", {"model": {"path": "m"}}, rows)
    _open_run(page, "flippy")
    expect(page.get_by_test_id("stage-train")).to_have_attribute("data-bottleneck", "true")
    assert page.get_by_test_id("stage-generate").get_attribute("data-bottleneck") == "false"
    window = page.get_by_test_id("bottleneck-window").inner_text()
    assert "last 10 step(s): train, 51% of their time" in window  # 9.5 / (9.0 + 9.5) = 51.4 %
    expect(page.get_by_test_id("chart-stage-share")).to_have_attribute("data-points", "12")
    assert page.problems == [], page.problems


def test_a_starting_run_shows_its_stages_then_alarms_and_its_efficiency_report(page, composer):
    """A run that has printed but not yet stepped: the start-up stages and the open log; then the trainer's
    first stage, its first step (the start-up box goes), a health alarm (a banner) and an efficiency report
    (its row, then report.json)."""
    _, _, runs_dir = composer
    folder = runs_dir / "starting"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "tokenmill-test-run"])
    try:
        _write_run(folder, {"model": {"path": "m"}}, [], seconds=None, pid=alive.pid, started=time.time() - 1)
        (folder / "log.txt").write_text("loading model m\n")
        _open_run(page, "starting")
        startup = page.get_by_test_id("startup")
        expect(startup).to_have_attribute("data-phase", "1")
        assert page.get_by_test_id("run-log-box").get_attribute("open") is not None
        expect(page.get_by_test_id("run-log")).to_contain_text("loading model m")
        _append(folder / "events.jsonl", {"event": "stage", "stage": "generate", "step": 1, "t": time.time()})
        expect(startup).to_have_attribute("data-phase", "3")
        _append(folder / "metrics.jsonl", _rl_rows(1.0, 1)[0])
        expect(startup).to_have_count(0)
        alarm = {"event": "alarm", "name": "reward_flat", "metric": "reward/std", "value": 0.0, "threshold": 1e-06,
                 "policy": "warn", "message": "every group scored alike for 5 steps", "step": 1}
        _append(folder / "events.jsonl", alarm)
        banner = page.get_by_test_id("alarm-reward_flat")
        expect(banner).to_contain_text("every group scored alike for 5 steps")
        assert "reward/std = 0" in banner.inner_text() and "policy warn" in banner.inner_text()
        _append(folder / "events.jsonl", {"event": "efficiency_report", "tokens_per_s": 1234.5})
        expect(page.get_by_test_id("efficiency-tokens_per_s")).to_contain_text("1234.50")
        (folder / "report.json").write_text(json.dumps({"efficiency": 0.8625, "shares": {"train": 0.25}}))
        _append(folder / "events.jsonl", {"event": "efficiency_report", "efficiency": 0.8625})
        expect(page.get_by_test_id("efficiency-shares.train")).to_contain_text("0.2500")  # report.json's, nested
        page.wait_for_timeout(300)  # the report request has answered: a 404 would be a console error
        assert page.problems == [], page.problems
    finally:
        alive.kill()
        alive.wait()


def test_the_models_page_shows_the_placement_of_a_ray_cluster_config(page, tiny_model_path):
    """A config with cluster settings: the Models page lists the devices of each role as `tokenmill plan`
    lays them out (the server's plan; nothing is started): 8 ranks on 2 nodes of 8 GPUs, 4 engine replicas
    of 2 GPUs each on the GPUs the ranks leave."""
    cluster = {"backend": "ray", "nodes": 2, "gpus_per_node": 8, "cpus_per_node": 16, "trainer_ranks": 8,
               "engine_replicas": 4, "gpus_per_engine": 2}
    page.get_by_test_id("yaml-input").fill(yaml.safe_dump({
        "mode": "rl", "model": {"path": tiny_model_path}, "data": {"task": "addition"}, "cluster": cluster}))
    page.get_by_test_id("import-yaml").click()
    expect(page.get_by_test_id("validation-status")).to_have_text("valid")
    with page.expect_response(lambda r: r.url.endswith("/api/estimate")) as answer:
        page.get_by_test_id("nav-models").click()
    placement = answer.value.json()["placement"]
    trainer = placement["trainer_devices"]
    engines = placement["engine_devices"]
    assert trainer == [f"node 0 cuda:{g}" for g in range(8)]  # PACK: the first node's 8 GPUs
    assert engines == [f"node 1 cuda:{2 * i},cuda:{2 * i + 1}" for i in range(4)]  # the second node, 2 each
    expect(page.get_by_test_id("placement-trainer")).to_have_attribute("data-devices", "|".join(trainer))
    expect(page.get_by_test_id("placement-engine")).to_have_attribute("data-devices", "|".join(engines))
    assert page.get_by_test_id("placement-trainer").inner_text().startswith("8 trainer rank(s)")
    assert page.get_by_test_id("placement-lines").text_content() == "\n".join(placement["lines"])
    assert page.problems == [], page.problems


def test_a_reward_preview_can_be_cancelled(page, tiny_model_path):
    """Cancel gives the page back at once while a slow reward is still being scored. (Last in this file: the
    server finishes the cancelled preview in the background.)"""
    page.get_by_test_id("yaml-input").fill(yaml.safe_dump({
        "mode": "rl", "model": {"path": tiny_model_path}, "data": {"task": "addition"},
        "generation": {"max_tokens": 2}}))
    page.get_by_test_id("import-yaml").click()
    expect(page.get_by_test_id("validation-status")).to_have_text("valid")
    page.get_by_test_id("nav-rewards").click()
    page.get_by_test_id("reward-name-0").fill("slow")
    page.get_by_test_id("reward-function-0").fill("slow")
    page.get_by_test_id("reward-editor-0").locator(".cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text("import time\n\ndef slow(prompts, completions, **kw):\n    time.sleep(15)\n"
                              "    return [1.0] * len(completions)\n")
    page.get_by_test_id("preview-prompts").fill("1")
    page.get_by_test_id("preview-samples").fill("1")
    page.get_by_test_id("preview-samples").press("Tab")
    page.get_by_test_id("preview-run").click()
    expect(page.get_by_test_id("preview-run")).to_have_text("Sampling…")
    started = time.monotonic()
    page.get_by_test_id("preview-cancel").click()
    expect(page.get_by_test_id("preview-cancelled")).to_be_visible(timeout=3_000)
    expect(page.get_by_test_id("preview-run")).to_have_text("Sample and score")
    assert time.monotonic() - started < 5 and page.get_by_test_id("preview-error").count() == 0
    assert page.problems == [], page.problems


def test_the_models_page_asks_for_a_model_before_estimating(page):
    """With no model chosen yet the Models page says what to do and sends no estimate request (one could only
    be refused, and the browser would log the refusal as a console error)."""
    asked: list[str] = []
    page.on("request", lambda r: "/api/estimate" in r.url and asked.append(r.url))
    page.get_by_test_id("nav-models").click()
    expect(page.get_by_test_id("memory-no-model")).to_contain_text("Choose a model (model.path")
    page.wait_for_timeout(600)  # past the estimate's 200 ms debounce
    assert asked == [] and page.problems == [], (asked, page.problems)
