"""Released checkpoints in and out: safetensors loading (released or HF names, FP8/FP4 kept or
dequantized), synthetic checkpoints in the released layout, Orbax save/restore of our params."""

from dsv41_jax.checkpoint.config import with_formats
from dsv41_jax.checkpoint.loader import (CheckpointError, Loaded, check_tensors, load_checkpoint, loaded_config,
                                         read_config)

__all__ = ["with_formats", "CheckpointError", "Loaded", "check_tensors",
           "load_checkpoint", "loaded_config", "read_config"]
