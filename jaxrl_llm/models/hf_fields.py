"""The fields `ModelConfig.from_hf` reads from a checkpoint's config.json, each checked for its JSON
type and range and refused by name: the file is one users point at, written by any tool. Python's
own conversions would accept what they should not (a string "false" is a true flag, a float
width reaches the shapes, a step of 0 divides by zero later) or fail far from the field."""

from __future__ import annotations

import math

_REQUIRED = object()


class Fields:
    """Typed reads of a config.json dict; a missing key, or one set to null, takes `default`. Errors
    name the key (`hf.load_config` adds the file)."""

    def __init__(self, hf: dict):
        self.hf = hf

    def _get(self, key: str, default):
        value = self.hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{key} is missing")
            return default, True
        return value, False

    def _bad(self, key: str, value, what: str) -> ValueError:
        return ValueError(f"{key}={value!r} must be {what}")

    def integer(self, key: str, default=_REQUIRED, least: int = 1):
        """An integer of at least `least` (a JSON boolean is not one)."""
        value, absent = self._get(key, default)
        if not absent and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise self._bad(key, value, f"an integer >= {least}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A JSON boolean."""
        value, absent = self._get(key, default)
        if not absent and not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def number(self, key: str, default, positive: bool = True) -> float:
        """A finite number, above 0 (`positive`) or at least 0."""
        value, absent = self._get(key, default)
        if absent:
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (positive and value == 0):
            raise self._bad(key, value, "a finite number " + ("> 0" if positive else ">= 0"))
        return float(value)

    def integers(self, key: str, least: int = 0) -> tuple:
        """A list of integers of at least `least`."""
        value, absent = self._get(key, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < least
                                              for v in value):
            raise self._bad(key, value, f"a list of integers >= {least}")
        return tuple(value)

    def token(self, key: str):
        """A token id, or the first of a list of them (`eos_token_id` may list several); None: unset."""
        value, absent = self._get(key, None)
        if absent:
            return None
        ids = value if isinstance(value, list) else [value]
        if not ids or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ids):
            raise self._bad(key, value, "a token id >= 0 or a non-empty list of them")
        return ids[0]
