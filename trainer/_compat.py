"""Optional dependencies: NumPy is used when installed, never required."""

from __future__ import annotations

import importlib
from typing import Any

np: Any = None
try:
    np = importlib.import_module("numpy")
except ImportError:  # pragma: no cover - numpy is present in the dev environment
    np = None
