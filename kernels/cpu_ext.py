"""The compiled CPU kernels (`specengine._quantext`, built from csrc/ at install), loaded once
for every op file here: `EXT` is the module, or None where it was not built (then every op
has its torch reference, and the ops table never offers a "cpu" choice)."""
from __future__ import annotations


def _load():
    try:
        from .. import _quantext
    except ImportError:  # not built (no compiler at install)
        return None
    return _quantext


EXT = _load()


def has(name: str) -> bool:
    """Whether the built extension has `name` (an older build may lack newer ops)."""
    return EXT is not None and hasattr(EXT, name)
