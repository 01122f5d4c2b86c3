"""Weight sync from the trainer to the engines: in-process, safetensors files, torch.distributed broadcast;
the sync of a kind (`engine.sync`) to engine servers is picked by `engines.remote.sync.for_servers`."""

from tokenmill.sync.base import WeightSync, WeightSyncError, merged_lora_weights
from tokenmill.sync.broadcast import BroadcastSync
from tokenmill.sync.files import FileSync
from tokenmill.sync.inprocess import InProcessSync

__all__ = ["BroadcastSync", "FileSync", "InProcessSync", "WeightSync", "WeightSyncError", "merged_lora_weights"]
