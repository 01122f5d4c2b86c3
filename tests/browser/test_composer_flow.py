"""The Composer end to end in headless chromium against the real backend and a tiny local model:
compose from a preset -> edit a reward -> the preview's scores -> export YAML that `tokenmill validate`
accepts -> launch a tiny run -> the curves grow -> the run finishes -> it is listed under Runs.

Every assertion compares what the page shows with what the API returned or with a hand computation.
One screenshot per page is written (see the `shots` fixture).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import yaml

expect = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)").expect

# score = the completion's length in characters: checkable by hand from the completion the page shows. The
# sleep spaces the tiny run's steps (~1 s each) beyond the server's 0.25 s tail poll, so the page receives the
# metrics rows one by one and the test sees the curve grow rather than all four points at once.
LENGTH_REWARD = (
    "import time\n\n"
    "def length_reward(prompts, completions, **columns):\n"
    "    time.sleep(1.0)\n"
    "    return [float(len(c)) for c in completions]\n"
)
BROKEN_REWARD = "def broken(prompts, completions, **columns):\n    raise ValueError('deliberately broken')\n"
TINY_RUN = {  # field path -> value typed into the form (on top of the laptop preset)
    "data.num_train": "64", "data.num_eval": "0", "generation.group_size": "2", "generation.max_tokens": "6",
    "controller.steps": "4", "controller.prompts_per_step": "2", "controller.eval_every": "0",
    "checkpoint.every": "0",
}


def _fill(page, path: str, value: str) -> None:
    box = page.get_by_test_id(f"field-{path}")
    box.fill(value)
    box.press("Tab")  # the form commits on change (blur), as a user leaving the field would


def _shot(page, shots, name: str) -> None:
    """Full-page screenshots from the top (the sidebar is sticky: scrolled, it would be drawn mid-page), at
    1280 x 800 and on a phone, 390 x 844, where the page must not scroll sideways."""
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.wait_for_timeout(300)  # charts resize on their ResizeObserver
        page.evaluate("window.scrollTo(0, 0)")
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1] == 390, (name, widths)
        page.screenshot(path=str(shots / f"{name}-phone.png"), full_page=True)
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def _set_code(page, index: int, code: str) -> None:
    """Replace a CodeMirror document the way a user pasting would (insert_text: no auto-indent)."""
    editor = page.get_by_test_id(f"reward-editor-{index}").locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(code)


def _compose(page, model_path: str) -> None:
    page.get_by_test_id("mode-rl").click()
    page.get_by_test_id("preset-laptop_cpu").click()
    # to_have_value retries: an input follows a new config one render after it (see field.tsx)
    expect(page.get_by_test_id("field-model.path")).to_have_value("Qwen/Qwen2.5-0.5B-Instruct")
    simple = page.get_by_test_id("fields").locator("[data-testid^=row-]").count()
    page.get_by_test_id("level-expert").click()
    expert = page.get_by_test_id("fields").locator("[data-testid^=row-]").count()
    assert expert > simple > 0  # levels disclose more fields
    _fill(page, "model.path", model_path)
    page.get_by_test_id("field-data.task").select_option("addition")
    for path, value in TINY_RUN.items():
        _fill(page, path, value)
    page.get_by_test_id("level-simple").click()
    status = page.get_by_test_id("validation-status")
    status.filter(has_text="valid").wait_for()
    assert status.inner_text() == "valid"


def _preview(page, shots) -> None:
    page.get_by_test_id("nav-rewards").click()
    page.get_by_test_id("reward-name-0").fill("length_reward")
    page.get_by_test_id("reward-name-0").press("Tab")
    page.get_by_test_id("reward-function-0").fill("length_reward")
    page.get_by_test_id("reward-function-0").press("Tab")
    _set_code(page, 0, LENGTH_REWARD)
    page.get_by_test_id("reward-weight-0").fill("0.5")
    assert page.get_by_test_id("reward-0").locator(".weight").inner_text() == "0.50"
    page.get_by_test_id("reward-add").click()
    page.get_by_test_id("reward-name-1").fill("broken")
    page.get_by_test_id("reward-name-1").press("Tab")
    page.get_by_test_id("reward-function-1").fill("broken")
    page.get_by_test_id("reward-function-1").press("Tab")
    _set_code(page, 1, BROKEN_REWARD)
    page.get_by_test_id("preview-prompts").fill("2")
    page.get_by_test_id("preview-samples").fill("2")
    page.get_by_test_id("preview-samples").press("Tab")
    with page.expect_response(lambda r: r.url.endswith("/api/rewards/preview"), timeout=90_000) as answer:
        page.get_by_test_id("preview-run").click()
    assert answer.value.status == 200, answer.value.text()
    body = answer.value.json()
    page.get_by_test_id("preview-table").wait_for()
    samples = body["samples"]
    assert len(samples) == 4  # 2 prompts x 2 samples
    weights = {r["name"]: r["weight"] for r in body["rewards"]}
    assert weights["length_reward"] == 0.5
    for i, sample in enumerate(samples):
        # the score is the completion's length (hand check), and the page shows exactly the API's number
        assert sample["scores"]["length_reward"] == float(len(sample["completion"]))
        cell = page.get_by_test_id(f"score-{i}-length_reward")
        assert float(cell.get_attribute("data-value")) == sample["scores"]["length_reward"]
        # the broken reward's error is inline, in its own cell, and the others still score
        error = page.get_by_test_id(f"score-{i}-broken").get_attribute("data-error")
        assert "deliberately broken" in error and error == sample["errors"]["broken"]
        scored = {k: v for k, v in sample["scores"].items() if v is not None}
        total = sum(weights[k] * v for k, v in scored.items())
        assert math.isclose(sample["total"], total, rel_tol=1e-9)
        assert math.isclose(float(page.get_by_test_id(f"total-{i}").get_attribute("data-value")), total, rel_tol=1e-9)
    _shot(page, shots, "rewards")
    page.get_by_test_id("reward-remove-1").click()  # the run trains on the working reward only
    assert page.get_by_test_id("reward-1").count() == 0


def _export(page, tmp_path, shots) -> None:
    page.get_by_test_id("nav-compose").click()
    with page.expect_response(lambda r: r.url.endswith("/api/yaml/export")) as answer:
        page.get_by_test_id("export-yaml").click()
    assert answer.value.status == 200, answer.value.text()
    exported, files = answer.value.json()["yaml"], answer.value.json()["files"]
    shown = page.get_by_test_id("yaml-output")
    shown.filter(has_text="controller").wait_for()
    assert shown.inner_text().strip() == exported.strip()
    # the reward written in the Rewards page travels with the YAML, as a file beside it
    assert [f["path"] for f in files] == ["rewards/length_reward.py"]
    assert yaml.safe_load(exported)["rewards"][0]["function"] == "rewards/length_reward.py:length_reward"
    button = page.get_by_test_id("export-file-rewards/length_reward.py")
    assert button.get_attribute("data-content") == files[0]["content"]
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "length_reward.py").write_text(button.get_attribute("data-content"))
    (tmp_path / "rl.yaml").write_text(shown.inner_text())
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "validate", "rl.yaml"], check=False,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # imports the reward file
    assert done.returncode == 0, done.stdout + done.stderr
    assert "valid. 4 steps of 2 prompts x 2 samples" in done.stdout
    assert page.get_by_test_id("yaml-stale").count() == 0
    # import the exported file back: the form shows the same values
    page.get_by_test_id("yaml-input").fill(exported.replace("steps: 4", "steps: 5"))
    page.get_by_test_id("import-yaml").click()
    page.get_by_test_id("yaml-message").filter(has_text="Imported").wait_for()
    expect(page.get_by_test_id("field-controller.steps")).to_have_value("5")
    page.get_by_test_id("yaml-stale").wait_for()  # the shown export no longer matches the form
    _fill(page, "controller.steps", "4")
    page.get_by_test_id("validation-status").filter(has_text="valid").wait_for()
    _shot(page, shots, "compose")


def _models(page, shots) -> None:
    page.get_by_test_id("nav-models").click()
    page.get_by_test_id("models-diagram").wait_for()
    page.get_by_test_id("memory").wait_for()
    assert page.get_by_test_id("diagram-actor").get_attribute("data-active") == "true"
    assert page.get_by_test_id("diagram-actor").get_attribute("data-device") == "cpu"
    assert page.get_by_test_id("diagram-critic").get_attribute("data-active") == "false"  # GRPO: no critic
    assert page.get_by_test_id("diagram-reference").get_attribute("data-active") == "false"  # kl_coef 0
    assert page.get_by_test_id("flow-reference-trainer").get_attribute("data-live") == "false"
    assert page.get_by_test_id("flow-generator-reward").get_attribute("data-live") == "true"


def _watch(page, shots) -> str:
    page.get_by_test_id("nav-watch").click()
    with page.expect_response(lambda r: r.url.endswith("/api/runs") and r.request.method == "POST") as answer:
        page.get_by_test_id("launch-run").click()
    assert answer.value.status == 201, answer.value.text()
    run_id = answer.value.json()["id"]
    page.get_by_test_id("run-id").filter(has_text=run_id).wait_for()
    chart = page.get_by_test_id("chart-reward")
    status = page.get_by_test_id("run-status")
    seen: list[int] = []
    deadline = time.monotonic() + 150
    while status.inner_text() != "finished":
        assert status.inner_text() not in ("failed", "stopped"), page.get_by_test_id("run-log").inner_text()
        assert time.monotonic() < deadline, f"run not finished; status {status.inner_text()}, points {seen}"
        points = int(chart.get_attribute("data-points"))
        if not seen or points != seen[-1]:
            seen.append(points)
        time.sleep(0.1)
    final = int(chart.get_attribute("data-points"))
    assert final == 4  # one point per step
    assert seen == sorted(seen) and set(seen) & {1, 2, 3}, seen  # the curve grew while we watched
    assert page.get_by_test_id("run-step").inner_text() == "step 4/4"
    page.get_by_test_id("samples-table").locator("tbody tr").first.wait_for()
    _shot(page, shots, "watch")
    return run_id


def _runs(page, run_id: str, shots) -> None:
    page.get_by_test_id("nav-runs").click()
    row = page.get_by_test_id(f"run-row-{run_id}")
    row.wait_for()
    assert "finished" in row.inner_text() and "4/4" in row.inner_text()
    _shot(page, shots, "runs")
    page.get_by_test_id(f"run-open-{run_id}").click()  # a finished run reopens from its files
    page.get_by_test_id("run-status").filter(has_text="finished").wait_for()
    page.wait_for_function("document.querySelector('[data-testid=chart-reward]').dataset.points === '4'")


def test_compose_preview_export_launch_watch(page, tiny_model_path, tmp_path, shots):
    _compose(page, tiny_model_path)
    _preview(page, shots)
    _export(page, tmp_path, shots)
    _models(page, shots)
    run_id = _watch(page, shots)
    _runs(page, run_id, shots)
    assert page.problems == [], page.problems


def test_memory_of_a_gpu_preset_follows_the_budget_slider(page, shots):
    """The 24 GB preset's estimate: the over-budget warning and the proposed micro-batch are the API's, and
    moving the budget slider re-estimates and shows the new proposal."""
    page.get_by_test_id("preset-gpu_24gb").click()
    with page.expect_response(lambda r: r.url.endswith("/api/estimate")) as answer:
        page.get_by_test_id("nav-models").click()
    estimate = answer.value.json()
    page.get_by_test_id("memory").wait_for()
    device = estimate["devices"][0]
    assert page.get_by_test_id(f"memory-device-{device['name']}").get_attribute("data-over") == \
        str(device["fits"] is False).lower()
    assert page.get_by_test_id("memory-warning").all_inner_texts() == estimate["warnings"]
    assert page.get_by_test_id("budget-micro-batch").inner_text() == str(estimate["budget"]["micro_batch"])
    assert page.get_by_test_id("diagram-actor").get_attribute("data-device") == "cuda:0"
    _shot(page, shots, "models")
    with page.expect_response(lambda r: r.url.endswith("/api/estimate")) as answer:
        page.get_by_test_id("budget-slider").fill("80")
    bigger = answer.value.json()
    assert bigger["budget"]["budget_bytes"] == 80 * 1024**3
    assert bigger["budget"]["micro_batch"] > estimate["budget"]["micro_batch"]
    page.get_by_test_id("budget-micro-batch").filter(has_text=str(bigger["budget"]["micro_batch"])).wait_for()
    assert page.problems == [], page.problems


@pytest.mark.parametrize("mode", ["sft", "preference", "reward_model"])
def test_each_mode_shows_its_own_options(page, mode):
    """The mode selector swaps the schema: fields that only one mode has appear and disappear."""
    page.get_by_test_id(f"mode-{mode}").click()
    page.get_by_test_id("sidebar-mode").filter(has_text={"sft": "SFT", "preference": "preference",
                                                         "reward_model": "Reward"}[mode]).wait_for()
    page.get_by_test_id("level-expert").click()
    page.get_by_test_id("field-model.path").wait_for()
    # retried: the new mode's schema may still be on its way, with the RL form shown meanwhile
    expect(page.get_by_test_id("field-controller.steps")).to_have_count(0)  # an RL-only field
    expect(page.get_by_test_id("field-steps")).to_have_count(1)
    assert (page.get_by_test_id("field-packing").count() == 1) == (mode == "sft")
    assert (page.get_by_test_id("field-objective").count() == 1) == (mode == "preference")
    assert page.problems == [], page.problems


def test_an_imported_unknown_key_is_left_out_and_named(page):
    """A YAML with a typo'd key imports as a valid config (the form could not show or remove the key); the
    message names the key that was left out."""
    page.get_by_test_id("yaml-input").fill("mode: rl\nmodel: {path: some/model, devcie: cpu}\n"
                                           "data: {task: addition}\ncontroller: {steps: 6}\n")
    page.get_by_test_id("import-yaml").click()
    message = page.get_by_test_id("yaml-message")
    message.filter(has_text="model.devcie").wait_for()
    assert "unknown key, left out of the imported config" in message.inner_text()
    expect(page.get_by_test_id("field-controller.steps")).to_have_value("6")
    expect(page.get_by_test_id("validation-status")).to_have_text("valid")


def test_a_launch_beyond_the_cap_shows_the_servers_reason_once(page, composer, tiny_model_path):
    """With --max-runs 1 and a run going, Launch shows the 409's message exactly as the API words it (no
    route prefix, nothing doubled)."""
    import httpx

    base, token, _ = composer
    config = {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
              "controller": {"steps": 100000}}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, trust_env=False, timeout=60) as c:
        running = c.post("/api/runs", json={"mode": "rl", "config": config}).json()["id"]
        try:
            page.get_by_test_id("yaml-input").fill(yaml.safe_dump({"mode": "rl", **config}))
            page.get_by_test_id("import-yaml").click()
            expect(page.get_by_test_id("validation-status")).to_have_text("valid")
            page.get_by_test_id("nav-watch").click()
            with page.expect_response(lambda r: r.url.endswith("/api/runs") and r.request.method == "POST") as a:
                page.get_by_test_id("launch-run").click()
            assert a.value.status == 409
            refused = a.value.json()
            assert refused["running"] == [running] and refused["max_runs"] == 1
            expect(page.get_by_test_id("launch-error")).to_have_text(refused["error"])
            assert refused["error"].startswith("runs: 1 run(s) already running")
        finally:
            assert c.post(f"/api/runs/{running}/stop").json()["status"] == "stopped"


def test_a_reload_keeps_the_composed_config_and_the_reward_code(page):
    _fill(page, "controller.steps", "7")
    page.get_by_test_id("nav-rewards").click()
    page.get_by_test_id("reward-name-0").fill("kept_reward")
    _set_code(page, 0, "# written before the reload\ndef kept_reward(completions, **kw):\n    return [1.0] * len(completions)\n")
    expect(page.get_by_test_id("reward-editor-0").locator(".cm-content")).to_contain_text("# written before the reload")
    page.reload()
    expect(page.get_by_test_id("reward-name-0")).to_have_value("kept_reward")  # the hash kept the page
    expect(page.get_by_test_id("reward-editor-0").locator(".cm-content")).to_contain_text("# written before the reload")
    page.get_by_test_id("nav-compose").click()
    expect(page.get_by_test_id("field-controller.steps")).to_have_value("7")


@pytest.mark.parametrize("name", ["compose", "rewards", "models", "watch", "runs"])
def test_no_page_scrolls_sideways_on_a_phone(browser, composer, name):
    """At 390 x 844 the sidebar turns into a bar on top and every page fits the width (a wide table or code
    block scrolls inside its own box)."""
    base, token, _ = composer
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    try:
        page.goto(f"{base}/?token={token}")
        page.get_by_test_id(f"nav-{name}").click()
        page.get_by_test_id(f"page-{name}").wait_for()
        page.wait_for_timeout(300)  # late data (schema, presets, runs) lays out
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth,"
                               " document.querySelector('.content').getBoundingClientRect().width]")
        assert widths[0] <= widths[1] == 390, widths
        assert widths[2] >= 360, widths  # the page gets the screen, not what a 220 px sidebar leaves
    finally:
        context.close()


def test_a_rewards_timeout_is_set_in_the_page(page, tiny_model_path):
    """The timeout of a page's reward is an input; a reward that spins is cut at the one typed, and the
    preview request carries it."""
    page.get_by_test_id("yaml-input").fill(yaml.safe_dump({
        "mode": "rl", "model": {"path": tiny_model_path}, "data": {"task": "addition"},
        "generation": {"max_tokens": 4}}))
    page.get_by_test_id("import-yaml").click()
    expect(page.get_by_test_id("validation-status")).to_have_text("valid")
    page.get_by_test_id("nav-rewards").click()
    page.get_by_test_id("reward-name-0").fill("spin")
    page.get_by_test_id("reward-function-0").fill("spin")
    _set_code(page, 0, "def spin(prompts, completions, **kw):\n    while True:\n        pass\n")
    expect(page.get_by_test_id("reward-timeout-0")).to_have_value("10")
    page.get_by_test_id("reward-timeout-0").fill("1.5")
    page.get_by_test_id("reward-timeout-0").press("Tab")
    page.get_by_test_id("preview-prompts").fill("1")
    page.get_by_test_id("preview-samples").fill("2")
    with page.expect_response(lambda r: r.url.endswith("/api/rewards/preview"), timeout=120_000) as answer:
        page.get_by_test_id("preview-run").click()
    assert answer.value.request.post_data_json["rewards"][0]["timeout_s"] == 1.5
    out = answer.value.json()
    spin = next(r for r in out["rewards"] if r["name"] == "spin")
    assert spin["error"].startswith("no result within 1.5s (worker killed)") and spin["seconds"] < 10
    expect(page.get_by_test_id("score-0-spin")).to_have_attribute("data-error", spin["error"])
