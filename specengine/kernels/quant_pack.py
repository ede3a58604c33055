"""GGUF blocks interleaved 8 rows at a time ("x8"), the layout of the CPU kernel's one-pass matvec.

A plain GGUF row keeps each super-block's scales next to its values, so a one-row dot product
pays the scale unpacking, the float conversions and a horizontal sum once per row and
super-block: about half of its instructions. Interleaving eight weight rows lets every vector
instruction serve all eight. llama.cpp's repacked CPU layouts rest on the same idea; this one is
ours, a byte permutation of the file's blocks (Q6_K's values also recoded bit by bit): same size
plus zero rows up to a multiple of 8, and `unpack_x8` gives the file's rows back exactly.

The layout is defined once, in C++ beside the kernels that read it (csrc/cpu/x8_layout.h: every
field's offsets, and why Q6_K's values are recoded); these are its packer and unpacker through the
binding. Without the compiled kernels nothing is held interleaved (`PACKED` is empty).
"""
from __future__ import annotations

import torch

from .cpu_ext import EXT, EXT_CODES, has
from .quant_matmul import FORMATS

ROWS = 8
# formats with an interleaved layout (and a kernel for it), as the binding defines them
PACKED: tuple[str, ...] = tuple(EXT.x8_formats()) if has("x8_formats") else ()


def _code(qtype: str) -> int:
    if qtype not in PACKED:
        raise ValueError(f"no interleaved layout for {qtype}; there is one for {', '.join(PACKED) or 'nothing'}"
                         + ("" if PACKED else " (the compiled CPU kernels are not built)"))
    return EXT_CODES[qtype]


def packed_bytes(qtype: str, rows: int, cols: int) -> tuple[int, int]:
    """Shape [groups, bytes per group] of a packed [rows, cols] weight."""
    values, nbytes = FORMATS[qtype]
    return -(-rows // ROWS), cols // values * nbytes * ROWS


def pack_x8(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """[N, row_bytes] GGUF rows -> [ceil(N / 8), 8 * row_bytes] interleaved groups (zero rows pad
    the last group; zero bytes are zero blocks)."""
    return EXT.pack_x8(qweight.contiguous(), _code(qtype))


def unpack_x8(packed: torch.Tensor, qtype: str, rows: int) -> torch.Tensor:
    """The inverse of `pack_x8`: the first `rows` GGUF rows, byte for byte (a tensor on another
    device comes back there, unpacked on the CPU)."""
    code = _code(qtype)
    if packed.device.type != "cpu":
        return EXT.unpack_x8(packed.cpu().contiguous(), code, rows).to(packed.device)
    return EXT.unpack_x8(packed.contiguous(), code, rows)
