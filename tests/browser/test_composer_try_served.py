"""Item 4 of the Composer's third pass, served: Try asks a `tokenmill serve` of the chosen model (a checkpoint of
a LoRA run here) and of the base model, and Export writes the checkpoint as a merged HF folder."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

expect = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)").expect

PROMPT = "7+5="


def _lora_run_with_a_checkpoint(folder, base_path: str) -> None:
    """A finished LoRA run that left checkpoint 2 (adapters moved off their zero start) and no final/ yet."""
    from tokenmill.checkpoint import save_checkpoint
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device

    model_cfg = {"path": base_path, "lora": {"rank": 2, "alpha": 4}}
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump({"model": model_cfg, "data": {"task": "addition"}}))
    (folder / "composer.json").write_text(json.dumps({"mode": "rl", "started": 1.7e9, "pid": None, "total_steps": 2}))
    (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0, "ended": 1.7e9 + 60}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5 * s}) + "\n" for s in (1, 2)))
    model, _ = load_policy(ModelConfig.model_validate(model_cfg), resolve_device("cpu"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    save_checkpoint(folder / "checkpoints", 2, model, {"step": 2})


def _transformers_greedy(path: str, max_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return [tok.decode([t]) for t in out[0, ids.shape[1]:].tolist()]


def test_a_checkpoint_is_tried_through_its_own_server_and_exported(page, composer, tiny_model_path, shots):
    _, _, runs_dir = composer
    run = runs_dir / "lora-try"
    _lora_run_with_a_checkpoint(run, tiny_model_path)
    page.get_by_test_id("nav-runs").click()
    page.get_by_test_id("run-open-lora-try").click()
    source = page.get_by_test_id("try-source")
    expect(source).to_have_value("step_00000002")  # no final/ yet: the newest checkpoint is offered
    page.get_by_test_id("try-prompt").fill(PROMPT)
    page.get_by_test_id("try-max-tokens").fill("5")
    page.get_by_test_id("try-max-tokens").press("Tab")
    with page.expect_response(lambda r: r.url.endswith("/try"), timeout=180_000) as answer:
        page.get_by_test_id("try-run").click()
    out = answer.value.json()
    exported = run / "exports" / "step_00000002"
    assert out["result"]["path"] == str(exported) and out["result"]["server"] != out["base"]["server"]
    for key, path in (("result", str(exported)), ("base", tiny_model_path)):
        tokens = page.get_by_test_id(f"try-answer-{key}").locator(".tok")
        expect(tokens).to_have_count(5)
        assert tokens.all_text_contents() == _transformers_greedy(path, 5), key
    with page.expect_response(lambda r: r.url.endswith("/export"), timeout=120_000):
        page.get_by_test_id("try-export").click()
    expect(page.get_by_test_id("try-exported")).to_contain_text(str(exported.resolve()))
    expect(page.get_by_test_id("try-exported")).to_contain_text(str((exported / "adapter").resolve()))
    for width, name in ((1280, "try-served"), (390, "try-served-phone")):  # the docs' pictures, desktop and phone
        page.set_viewport_size({"width": width, "height": 844})
        page.get_by_test_id("try-panel").scroll_into_view_if_needed()
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        page.get_by_test_id("try-panel").screenshot(path=str(shots / f"{name}.png"))
    assert page.problems == [], page.problems
