"""Try the result through `tokenmill serve` (a real server per model folder on loopback, behind a token), and
export a LoRA run's checkpoint as a merged HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "12+3="


def _run(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    (folder / "composer.json").write_text(json.dumps({"mode": "rl", "started": 1.0, "pid": None}))
    (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0, "ended": 9.0}))
    return folder


def _greedy(path: str, max_tokens: int) -> list[int]:
    """transformers' own greedy continuation of PROMPT by the model at `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=False) if tok.chat_template else PROMPT
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def client(runs_dir):
    with TestClient(create_app(TOKEN, runs_dir), base_url="http://127.0.0.1", headers=AUTH) as c:
        yield c


def test_the_result_and_its_base_are_answered_by_their_own_servers(client, runs_dir, tiny_model_path, tmp_path):
    """Each answer comes from a `tokenmill serve` of that folder on loopback (401 without the Composer's
    token) and is transformers' greedy decoding token for token; the servers stop with the Composer."""
    from tokenmill.testing import build_tiny_model

    trained = build_tiny_model(tmp_path / "trained", hidden_size=32, num_layers=1, seed=7)
    run = _run(runs_dir / "tried", {"model": {"path": tiny_model_path}, "data": {"task": "addition"}})
    assert client.post("/api/runs/tried/try", json={"prompt": PROMPT}).status_code == 409  # no final/ yet
    (run / "final").symlink_to(Path(trained), target_is_directory=True)
    out = client.post("/api/runs/tried/try", json={"prompt": PROMPT, "max_tokens": 6}).json()
    for key, path in (("result", trained), ("base", tiny_model_path)):
        answer = out[key]
        assert answer["token_ids"] == _greedy(path, 6), key
        assert len(answer["tokens"]) == 6 and all(t["logprob"] <= 0 for t in answer["tokens"])
        assert answer["server"].startswith("http://127.0.0.1:") and answer["route"] == "chat"  # the tokenizer has a template
        refused = httpx.post(answer["server"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert refused.status_code == 401  # the server is the Composer's alone
    assert client.get("/api/runs/tried/models").json()["servers"] == [str(run / "final"), tiny_model_path]
    again = client.post("/api/runs/tried/try", json={"prompt": PROMPT, "max_tokens": 6}).json()
    assert again["result"]["server"] == out["result"]["server"]  # kept up between questions


def test_at_most_two_servers_stay_up_and_all_stop_on_shutdown(tiny_model_path, tmp_path):
    from tokenmill.composer.trial import Trial
    from tokenmill.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=32, num_layers=1, seed=3)
    app = create_app(TOKEN, tmp_path / "runs")
    with TestClient(app, base_url="http://127.0.0.1", headers=AUTH):
        trial: Trial = app.state.trial
        first = trial.answer(tiny_model_path, PROMPT, 2)["server"]
        trial.answer(other, PROMPT, 2)
        trial.answer(tiny_model_path, PROMPT, 2)  # the most recent again: `other` is now the oldest
        third = build_tiny_model(tmp_path / "third", hidden_size=32, num_layers=1, seed=4)
        trial.answer(third, PROMPT, 2)
        assert trial.servers.alive() == [tiny_model_path, third]
        assert trial.answer(tiny_model_path, PROMPT, 2)["server"] == first
        procs = [proc for proc, _ in trial.servers._live.values()]
    assert all(p.poll() is not None for p in procs) and trial.servers.alive() == []


def test_a_lora_checkpoint_is_exported_merged_and_tried(client, runs_dir, tiny_model_path):
    """A LoRA run's checkpoint: Export writes the adapters merged into a plain HF folder (the adapter beside
    it), whose logits are the adapted model's; Try serves that folder."""
    from transformers import AutoModelForCausalLM

    from tokenmill.checkpoint import save_checkpoint
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device

    model_cfg = {"path": tiny_model_path, "lora": {"rank": 4, "alpha": 8}}
    run = _run(runs_dir / "lora", {"model": model_cfg, "data": {"task": "addition"}})
    model, tok = load_policy(ModelConfig.model_validate(model_cfg), resolve_device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (a no-op adapter): give it something to merge
                p.copy_(torch.randn_like(p) * 0.5)
    save_checkpoint(run / "checkpoints", 3, model, {"step": 3})
    listed = client.get("/api/runs/lora/models").json()["sources"]
    assert listed == [{"name": "final", "ready": False}, {"name": "step_00000003", "ready": True, "exported": False}]
    assert client.post("/api/runs/lora/export", json={"source": "step_00000009"}).status_code == 404
    out = client.post("/api/runs/lora/export", json={"source": "step_00000003"}).json()
    assert out["path"] == str((run / "exports" / "step_00000003").resolve())
    assert out["adapter"] == str((run / "exports" / "step_00000003" / "adapter").resolve())
    merged = AutoModelForCausalLM.from_pretrained(out["path"], dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)(ids).logits
    assert (base - merged(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    answer = client.post("/api/runs/lora/try", json={"prompt": PROMPT, "max_tokens": 5,
                                                     "source": "step_00000003"}).json()["result"]
    assert answer["path"] == str(run / "exports" / "step_00000003") and answer["token_ids"] == _greedy(out["path"], 5)
    assert client.get("/api/runs/lora/models").json()["sources"][1]["exported"] is True
