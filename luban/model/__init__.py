"""The model: one description (``ModelConfig``), its presets, its cost formulas, and the network."""

from luban.model.config import ModelConfig
from luban.model.presets import get_preset, preset_names

__all__ = ["ModelConfig", "get_preset", "preset_names"]
