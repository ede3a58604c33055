"""Decoding methods, one file each, selected by name (docs/design.md, "Methods")."""
from .ar import AutoRegressive
from .base import Method
from .parallelspec import ParallelSpec
from .pearl import Pearl
from .sd import SpeculativeDecoding

METHODS: dict[str, type[Method]] = {m.name: m for m in (AutoRegressive, SpeculativeDecoding, Pearl, ParallelSpec)}

__all__ = ["METHODS", "Method"]
