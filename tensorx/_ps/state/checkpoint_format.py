"""A shard's checkpoint files as data: the format, reading one (tensors and literals only),
and the CPU copy of an optimizer state that a checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tensorx._ps.state import checkpoint
from tensorx.errors import UsageError

__all__ = ["CHECKPOINT_FORMAT", "load_checkpoint", "read_checkpoint", "to_cpu"]

CHECKPOINT_FORMAT = 2  # 2: optimizer state over the model's parameters, in model order


def to_cpu(value: Any) -> Any:
    """``value`` (an optimizer ``state_dict``, nested dicts and lists) with every tensor
    copied to host: checkpoints hold CPU tensors whatever the server's device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if value.is_cuda else value
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if type(value) is tuple:
        return tuple(to_cpu(v) for v in value)
    return value


def read_checkpoint(path: Path) -> Any:
    """One checkpoint file's contents (tensors and literals only: no pickle); UsageError for
    a readable file this version cannot resume (an older format)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        return state  # not ours at all: reported as damaged
    if state.get("format") == 1:
        raise UsageError(
            f"{path} was written by an older tensorx (checkpoint format 1): its plan chunks "
            "tensors differently and its optimizer state is per plan entry, so this version "
            "cannot resume it. Finish that run with the tensorx that wrote it, or start "
            "without the checkpoint")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{path}: unknown checkpoint format {state.get('format')!r}")
    return state


def load_checkpoint(path: Path, keep: int = checkpoint.KEEP) -> dict[str, Any] | None:
    """The newest usable checkpoint at ``path`` or an older generation (None: none exists);
    UsageError when each one there is damaged or another user could have planted it."""
    return checkpoint.load(path, read_checkpoint, keep)
