"""Decoding methods, one file each and siblings (ar, sd, pearl, parallelspec, ngram / hybrid), over the round
steps they share (steps.py), sampling, token trees and draft-length policies; a method sees
only its MethodContext, never the Engine (docs/design.md, "Methods")."""
from .ar import AutoRegressive
from .base import Method
from .hybrid import HybridDecoding, HybridSuffixDecoding
from .ngram import NgramDecoding, SuffixDecoding
from .parallelspec import ParallelSpec
from .pearl import Pearl
from .sd import SpeculativeDecoding

METHODS: dict[str, type[Method]] = {m.name: m for m in (AutoRegressive, SpeculativeDecoding, Pearl, ParallelSpec,
                                                          NgramDecoding, HybridDecoding, SuffixDecoding,
                                                          HybridSuffixDecoding)}

__all__ = ["METHODS", "Method"]
