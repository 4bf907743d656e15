"""The model settings every two-model command shares (`--cloud`, `--edge`, `--dtype`, `--device`), written once:
a command's config inherits them."""

from __future__ import annotations

from dataclasses import dataclass

from edgekv.config import cloud_setting, device_setting, dtype_setting, edge_setting
from edgekv.models.loading import resolve_dtype


@dataclass
class ModelSettings:
    """The cloud and edge models and how they run."""

    cloud: str = cloud_setting()
    edge: str = edge_setting()
    dtype: str = dtype_setting()
    device: str = device_setting()

    def check_models(self) -> None:
        """One-line error for a dtype that does not exist, and `auto` made the dtype it stands for here (before
        any model loads), so the run's config records what it computed in."""
        self.dtype = resolve_dtype(self.dtype, self.device)
