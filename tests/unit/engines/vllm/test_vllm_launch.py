"""`tokenmill vllm`: a LoRA rank vLLM does not take is rounded up (and said), and a server that dies while
serving ends the command with one line and a non-zero status. A small HTTP process stands in for vLLM's
server (a venv whose `python` answers /health, records its argv and exits): no vLLM is needed."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.engines.vllm.launch import LORA_RANKS, READY_MARKER, VLLMError, lora_flags, lora_rank_for

# `python -m vllm.entrypoints.openai.api_server ... --port P`: answers /health for LIFETIME seconds, then exits 3
FAKE_SERVER = """#!{python}
import http.server, json, os, sys, threading, time
argv = sys.argv[1:]
with open({argv_file!r}, "w") as f:
    json.dump(argv, f)
with open({argv_file!r} + ".env", "w") as f:
    json.dump({{k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}, f)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep({lifetime})
sys.exit(3)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_SERVER.format(python=sys.executable, argv_file=str(tmp_path / "argv.json"), lifetime=3))
    python.chmod(0o755)
    (venv / READY_MARKER).write_text("fake\n")
    return venv


def _serve(tmp_path: Path, venv: Path, *flags: str) -> list[str]:
    return ["vllm", str(tmp_path), "--venv", str(venv), "--port", str(_free_port()), "--timeout-s", "60", *flags]


def test_lora_ranks_round_up_to_one_vllm_takes():
    assert [lora_rank_for(r) for r in (1, 2, 4, 8, 9, 16, 300, 320, 321, 512)] == [
        1, 8, 8, 8, 16, 16, 320, 320, 512, 512]
    assert LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
    assert lora_flags(4) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    with pytest.raises(VLLMError, match="up to rank 512"):
        lora_rank_for(513)


def test_a_server_that_dies_ends_the_command_with_one_line(tmp_path, fake_venv, capsys):
    code = main(_serve(tmp_path, fake_venv))
    out, err = capsys.readouterr()
    assert code == 1
    assert "vLLM ready at" in out
    [line] = err.splitlines()
    assert line.startswith("tokenmill: the vLLM server at http://127.0.0.1:") and " exited with status 3; its log: " in line


def test_lora_rank_4_serves_rank_8_and_says_so(tmp_path, fake_venv, capsys):
    assert main(_serve(tmp_path, fake_venv, "--lora-rank", "4")) == 1  # the stand-in exits after 3 s
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("--lora-rank 4: vLLM takes a max LoRA rank of 1, 8, 16, 32, 64, 128, 256, 320, "
                                   "512; serving with 8 (adapters up to rank 8 load)")
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in argv


def test_a_rank_beyond_vllms_is_refused_before_anything_starts(tmp_path, fake_venv, capsys):
    assert main(_serve(tmp_path, fake_venv, "--lora-rank", "600")) == 1
    assert capsys.readouterr().err.strip() == "tokenmill: --lora-rank 600: vLLM serves LoRA adapters up to rank 512"
    assert not (tmp_path / "argv.json").exists()


def test_routed_experts_start_vllms_v2_runner_with_its_flag(tmp_path, fake_venv, capsys):
    assert main(_serve(tmp_path, fake_venv, "--enable-return-routed-experts")) == 1  # the stand-in exits after 3 s
    argv = json.loads((tmp_path / "argv.json").read_text())
    env = json.loads((tmp_path / "argv.json.env").read_text())
    assert "--enable-return-routed-experts" in argv and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert main(_serve(tmp_path, fake_venv)) == 1
    assert "--enable-return-routed-experts" not in json.loads((tmp_path / "argv.json").read_text())
    assert "VLLM_USE_V2_MODEL_RUNNER" not in json.loads((tmp_path / "argv.json.env").read_text())
