"""The counter-based hash of `rng.counter_uniform`, in Triton, bit for bit.

Arithmetic is done on uint32 values held in int64 (wrapping products, then masked),
exactly as the torch reference does, so both paths draw the same numbers.
"""
import triton
import triton.language as tl

GOLDEN = 0x9E3779B9
M32 = 0xFFFFFFFF


def stream_key(stream: int) -> int:
    return (stream * GOLDEN) & M32


@triton.jit
def mix32(x):
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def counter_uniform(seed, offset, pos, idx, key):
    """Uniform fp32 in (0, 1); every argument is int64 (scalars or tensors)."""
    h = mix32(seed ^ key)
    h = mix32(h ^ (seed >> 32))
    h = mix32(h ^ offset)
    h = mix32(h ^ pos)
    h = mix32(h ^ idx)
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
