"""vLLM as an engine: `launch` builds its venv and starts its OpenAI server (every vLLM-specific name lives
there), `sync` pushes weights into it, `worker_ext` runs inside vLLM's workers and receives them. Sampling
goes through the server's OpenAI routes, so the engine object is `engines.remote.RemoteEngine`."""

from tokenmill.engines.vllm.launch import (
    LORA_ADAPTER_NAME,
    PACKAGE,
    VERSION,
    WEIGHT_INFO,
    VLLMError,
    VLLMNotInstallable,
    VLLMServer,
    default_venv,
    ensure_venv,
    server_command,
    start_server,
    write_worker_extension,
)
from tokenmill.engines.vllm.sync import VLLMBroadcastSync, VLLMLoRASync, VLLMReloadSync

__all__ = [
    "LORA_ADAPTER_NAME", "PACKAGE", "VERSION", "WEIGHT_INFO", "VLLMBroadcastSync", "VLLMError", "VLLMLoRASync",
    "VLLMNotInstallable", "VLLMReloadSync", "VLLMServer", "default_venv", "ensure_venv", "server_command",
    "start_server", "write_worker_extension",
]
