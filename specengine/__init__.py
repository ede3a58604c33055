"""specengine: lossless, low-latency LLM generation with speculative decoding."""
import os as _os
import sys as _sys

if "torch" not in _sys.modules and _os.environ.get("SPECENGINE_THP", "1") != "0":
    # Decoding streams every weight once per step. With 4 KB pages the CPU's prefetchers stop
    # at each page and the TLB misses constantly; torch backs large tensors with transparent
    # huge pages when this is set, which it reads once, at its first allocation (so only
    # when specengine is imported before torch). docs/design.md, "CPU matmul paths".
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .api import Engine, GenerationResult
from .config import EngineConfig
from .errors import SpecEngineError
from .methods.sampling import SamplingParams
from .request import RequestParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "RequestParams", "SamplingParams", "SpecEngineError"]
__version__ = "0.1.0"
