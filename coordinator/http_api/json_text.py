"""Checks of a parsed JSON body's values that pydantic does not make (pure)."""
from __future__ import annotations


def lone_surrogate_at(value, path: str = "") -> str | None:
    """Where a JSON body holds a string that is not Unicode text (a lone UTF-16 surrogate, "\\ud800"); None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if found := lone_surrogate_at(k, path or "body") or lone_surrogate_at(v, where):
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if where := lone_surrogate_at(v, f"{path}.{i}" if path else str(i)):
                return where
    return None
