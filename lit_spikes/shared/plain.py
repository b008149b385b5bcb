"""Configs as plain data: what a checkpoint, a JSON ledger or a YAML file stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plain_config(value: Any) -> Any:
    """Plain data, recursively: tuples as lists, paths as strings, keys as strings; a
    config as a checkpoint or a JSON file stores it (a round trip is exact)."""
    if isinstance(value, dict):
        return {str(key): plain_config(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [plain_config(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config with dotted keys (``world.num_chars``), one level."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= flat_config(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
