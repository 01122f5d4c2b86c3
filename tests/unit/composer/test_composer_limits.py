"""The Composer's limits: a cap on concurrent runs (real `tokenmill train` subprocesses), a timeout on a reward
model in the reward preview, and preview workers that die with the Composer."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tokenmill.cli import main
from tokenmill.composer.app import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(runs_dir: Path, **kwargs) -> TestClient:
    return TestClient(create_app(TOKEN, runs_dir, **kwargs), base_url="http://127.0.0.1", headers=AUTH)


def _long_run(model: str) -> dict:
    return {"mode": "rl", "config": {"model": {"path": model}, "data": {"task": "addition", "num_eval": 0},
                                     "controller": {"steps": 100000}}}


def test_a_launch_beyond_max_runs_is_a_clear_409(tmp_path, tiny_model_path):
    body = _long_run(tiny_model_path)
    with _client(tmp_path, max_runs=1) as client:
        assert client.get("/api/runs").json() == {"runs": [], "max_runs": 1}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # racing launches: the cap still holds
            answers = list(pool.map(lambda _: client.post("/api/runs", json=body), range(3)))
        assert sorted(r.status_code for r in answers) == [201, 409, 409]
        first = next(r.json()["id"] for r in answers if r.status_code == 201)
        refused = next(r.json() for r in answers if r.status_code == 409)
        assert refused == {
            "error": f"runs: 1 run(s) already running, the most this Composer starts at once (--max-runs 1); "
                     f"stop one or wait for it to end: {first}",
            "running": [first], "max_runs": 1}
        # a restarted Composer on the same folder counts the run it did not launch
        with _client(tmp_path, max_runs=1) as again:
            assert again.post("/api/runs", json=body).json()["running"] == [first]
        assert client.post(f"/api/runs/{first}/stop").json()["status"] == "stopped"
        second = client.post("/api/runs", json=body)
        assert second.status_code == 201, second.text
        assert client.post(f"/api/runs/{second.json()['id']}/stop").json()["status"] == "stopped"
        assert [r["status"] for r in client.get("/api/runs").json()["runs"]] == ["stopped", "stopped"]


def test_max_runs_two_allows_two(tmp_path, tiny_model_path):
    body = _long_run(tiny_model_path)
    with _client(tmp_path, max_runs=2) as client:
        ids = [client.post("/api/runs", json=body).json()["id"] for _ in range(2)]
        third = client.post("/api/runs", json=body)
        assert third.status_code == 409 and sorted(third.json()["running"]) == sorted(ids)
        for run_id in ids:
            assert client.post(f"/api/runs/{run_id}/stop").json()["status"] == "stopped"


def test_cli_refuses_max_runs_below_one(capsys):
    assert main(["composer", "--max-runs", "0", "--port", "0"]) == 2
    assert "--max-runs must be at least 1 (got 0)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ reward models
@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory) -> str:
    """A 1-layer sequence classifier with one label on the character tokenizer: a real reward model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tokenmill.testing import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # clearly distinct scores
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _preview_body(model: str, rewards: list[dict], **extra) -> dict:
    return {"mode": "rl", "config": {"model": {"path": model}, "data": {"task": "addition"},
                                     "generation": {"max_tokens": 4}, "rewards": rewards},
            "prompts": 2, "samples": 2, **extra}


def test_a_reward_model_in_the_preview_scores_its_logit(tmp_path, tiny_model_path, reward_model_path):
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    with _client(tmp_path) as client:
        r = client.post("/api/rewards/preview", json=_preview_body(tiny_model_path, [{"path": reward_model_path,
                                                                                     "weight": 0.5}]))
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(i["name"], i["source"], i["error"]) for i in out["rewards"]] == [("addition", "task", None),
                                                                               ("rm", "config", None)]
    model = LlamaForSequenceClassification.from_pretrained(reward_model_path).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_path)
    for s in out["samples"]:
        with torch.no_grad():
            logit = model(**tok(s["prompt"] + s["completion"], return_tensors="pt")).logits[0, 0].item()
        assert s["scores"]["rm"] == pytest.approx(logit, abs=1e-5)
        assert s["total"] == pytest.approx(s["scores"]["addition"] + 0.5 * logit, abs=1e-5)


RELEASE = threading.Event()  # set at the end of the test: the abandoned threads return


def _hanging_reward_model(folder: Path, hang_at: str) -> str:
    """A reward model folder of a custom architecture (registered with transformers' Auto classes, as a user's
    own model would be) that blocks in its constructor ("load") or in its forward pass ("score")."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

    from tokenmill.testing import build_tokenizer

    class HangConfig(PretrainedConfig):
        model_type = "tokenmill_test_hang"

        def __init__(self, hang_at: str = "score", **kwargs) -> None:
            super().__init__(**kwargs)
            self.hang_at = hang_at

    class HangModel(PreTrainedModel):
        config_class = HangConfig

        def __init__(self, config: HangConfig) -> None:
            super().__init__(config)
            self.score = torch.nn.Linear(1, 1)
            if config.hang_at == "load":
                RELEASE.wait()
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            RELEASE.wait()
            return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], 1)})()

    with contextlib.suppress(ValueError):  # registered once per process
        AutoConfig.register(HangConfig.model_type, HangConfig)
        AutoModelForSequenceClassification.register(HangConfig, HangModel)
    HangModel(HangConfig(hang_at="score", num_labels=1)).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"hang_at": "score"', f'"hang_at": "{hang_at}"'))
    return str(folder)


@pytest.mark.parametrize("hang_at,what", [("load", "load"), ("score", "score")])
def test_a_hanging_reward_model_does_not_hang_the_preview(tmp_path, tiny_model_path, hang_at, what):
    hung = _hanging_reward_model(tmp_path / "hung", hang_at)
    try:
        with _client(tmp_path / "runs") as client:
            start = time.monotonic()
            r = client.post("/api/rewards/preview", json=_preview_body(
                tiny_model_path, [{"path": hung, "name": "hung"}], reward_model_timeout_s=2))
            elapsed = time.monotonic() - start
    finally:
        RELEASE.set()
    assert r.status_code == 200, r.text
    assert elapsed < 30  # policy load + sampling + the 2 s budget, not forever
    out = r.json()
    error = f"rewards.0.path: the reward model did not {what} within 2s (abandoned)"
    assert {i["name"]: i["error"] for i in out["rewards"]} == {"addition": None, "hung": error}
    assert 1.9 < next(i["seconds"] for i in out["rewards"] if i["name"] == "hung") < 4
    for s in out["samples"]:
        assert s["scores"]["hung"] is None and s["errors"]["hung"] == error
        assert s["scores"]["addition"] in (0.0, 1.0) and s["total"] == s["scores"]["addition"]
    RELEASE.clear()


# ------------------------------------------------------------------------------------------ lifetime
def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _state(pid: int) -> str:
    """R running, S sleeping, Z dead but not reaped (a zombie), "" gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    return _state(pid) in ("", "Z")


def test_preview_workers_die_with_the_composer(tmp_path, tiny_model_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1",
           "TOKENMILL_COMPOSER_TOKEN": TOKEN}
    composer = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "composer", "--port", "0", "--runs-dir",
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    answer: list[str] = []
    worker = None
    pid_file = tmp_path / "worker.pid"
    try:
        url = re.search(r"http://[^/\s]+", composer.stdout.readline()).group(0)
        # the rest of the Composer's output is drained, so a full pipe never blocks it, and shown on failure
        threading.Thread(target=lambda: output.extend(composer.stdout), daemon=True).start()
        code = (f"import os\ndef spin(prompts, completions, **kw):\n"
                f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    while True:\n        pass\n")
        spin = {"name": "spin", "code": code, "function": "spin", "timeout_s": 300}
        body = {**_preview_body(tiny_model_path, []), "rewards": [spin]}

        def post() -> None:
            try:
                r = httpx.post(f"{url}/api/rewards/preview", json=body, headers=AUTH, timeout=330, trust_env=False)
                answer.append(f"{r.status_code} {r.text[:2000]}")
            except httpx.HTTPError as e:
                answer.append(repr(e))

        threading.Thread(target=post, daemon=True).start()
        deadline = time.monotonic() + 300  # seconds alone; minutes on a loaded machine
        while worker is None and not answer and time.monotonic() < deadline:  # the reward's forked worker, spinning
            with contextlib.suppress(OSError, ValueError):
                worker = int(pid_file.read_text())
            time.sleep(0.1)
        children = {pid: _state(pid) for pid in _children(composer.pid)}
        assert worker is not None, (f"no reward worker ran; preview answered {answer}; children and states {children}; "
                                    f"Composer said {output[-40:]}")
        assert worker in _children(composer.pid) and not _gone(worker)
        composer.kill()  # SIGKILL: no cleanup code runs in the Composer
        composer.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), f"reward worker {worker} outlived the Composer"
    finally:
        composer.kill()
        composer.wait(timeout=10)
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_stopping_a_run_leaves_no_traceback_in_its_log(tmp_path, tiny_model_path):
    code = "def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n"
    body = {"mode": "rl", "config": {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
                                     "generation": {"group_size": 2, "max_tokens": 4},
                                     "controller": {"steps": 100000, "prompts_per_step": 2}},
            "rewards": [{"name": "short", "code": code, "function": "short"}]}
    with _client(tmp_path) as client:
        launched = client.post("/api/runs", json=body).json()
        pid = json.loads((Path(launched["output_dir"]) / "composer.json").read_text())["pid"]
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(_children(pid)) < 2:
                time.sleep(0.1)  # the first step is being scored: both reward workers (task and code) are forked
            assert len(_children(pid)) == 2, "no reward workers"
            assert client.post(f"/api/runs/{launched['id']}/stop").json()["status"] == "stopped"
            deadline = time.monotonic() + 60  # the run writes its last line and exits
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _gone(pid), "the stopped run is still running after 60 s"
        finally:  # a failed check must not leave a 100,000-step run training on the machine
            for leftover in [*_children(pid), pid] if not _gone(pid) else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(leftover, signal.SIGKILL)
    log = (Path(launched["output_dir"]) / "log.txt").read_text()
    last = log.rstrip().splitlines()[-1]  # the run saved at the step boundary and said how to resume
    assert "--checkpoint.resume true" in last and "(exit status 75)" in last, log[-2000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-2000:]


def test_the_bundle_is_served_gzipped_to_browsers_that_take_it(tmp_path):
    from tokenmill.composer.app import STATIC_DIR

    plain = (STATIC_DIR / "app.js").read_bytes()
    with _client(tmp_path) as client:
        zipped = client.get("/static/app.js", headers={"Accept-Encoding": "gzip, deflate, br"})
        identity = client.get("/static/app.js", headers={"Accept-Encoding": "identity"})
        css = client.get("/static/app.css", headers={"Accept-Encoding": "gzip"})
    assert zipped.status_code == 200 and zipped.headers["content-encoding"] == "gzip"
    assert zipped.content == plain  # httpx undoes the encoding
    assert int(zipped.headers["content-length"]) < 0.4 * len(plain)  # 573 KB -> 198 KB
    assert zipped.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert "content-encoding" not in identity.headers and identity.content == plain
    assert css.headers["content-type"].startswith("text/css") and css.content == (STATIC_DIR / "app.css").read_bytes()
