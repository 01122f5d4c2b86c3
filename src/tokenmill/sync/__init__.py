"""Weight sync from the trainer to the engines: in-process, safetensors files, torch.distributed broadcast;
`for_servers` picks the sync of a kind (`engine.sync`) to engine servers."""

from tokenmill.sync.base import WeightSync, WeightSyncError, merged_lora_weights
from tokenmill.sync.broadcast import BroadcastSync
from tokenmill.sync.files import FileSync
from tokenmill.sync.inprocess import InProcessSync
from tokenmill.sync.servers import for_servers

__all__ = ["BroadcastSync", "FileSync", "InProcessSync", "WeightSync", "WeightSyncError", "for_servers",
           "merged_lora_weights"]
