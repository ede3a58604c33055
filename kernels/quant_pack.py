"""GGUF blocks interleaved 8 rows at a time ("x8"), the layout of the CPU kernel's one-pass matvec.

A plain GGUF row keeps each super-block's scales next to its values, so a one-row dot product
pays the scale unpacking, the float conversions and a horizontal sum once per row and
super-block: about half of its instructions. Interleaving eight weight rows lets every
vector instruction serve all eight: lane r of a vector holds row r, the scales of eight rows
unpack in one pass, and each row's sum ends in its own lane (no horizontal sum). llama.cpp's
repacked CPU layouts rest on the same idea; this one is ours, a byte permutation of the file's
blocks (Q6_K's values also recoded bit by bit, below): same size (plus zero rows up to a multiple
of 8), and `unpack_x8` gives the file's rows back exactly.

Q4_K, per group of 8 rows and super-block (8 x 144 = 1152 bytes):
    d     [8 rows][2]         the rows' fp16 super-block scales
    dmin  [8 rows][2]         their fp16 super-block mins
    scales[3 words][8 rows][4] the 12 packed 6-bit scale/min bytes, as three 32-bit words per row
    qs    [4 c][8 t][8 rows][4] bytes 32c + 4t .. 32c + 4t + 3 of each row's 128 value bytes
Q4_0 / Q5_0, per group and 32-value block (8 x 18 = 144 / 8 x 22 = 176 bytes):
    d     [8 rows][2]         fp16 scales
    qh    [8 rows][4]         (Q5_0) each row's 32 high bits, as in the file
    qs    [4 t][8 rows][4]    value bytes 4t .. 4t + 3 of each row (byte l: values l and l + 16)
Q6_K, per group and super-block (8 x 210 = 1680 bytes):
    d     [8 rows][2]         fp16 scales
    scales[4 words][8 rows][4] the 16 int8 sub-block scales, four per word
    values[2 h][8 t][3][8 rows][4]  per (h, t), byte b of row r, with v_k = the 6-bit value
                                    128h + 32k + 4t + b (0..63, as the file's low nibble and high bits
                                    make it): A = v_0 | (v_2 >> 4) << 6, B = v_1 | (v_3 >> 4) << 6,
                                    C = (v_2 & 15) | (v_3 & 15) << 4
The Q6_K values are the one place the layout recodes bits rather than moving bytes: the file's
order (low nibbles of v_0 | v_2 and of v_1 | v_3, then the four values' high bits) costs 18 vector
instructions per four vectors of values, A/B/C 11 (v_0 = A & 63, v_2 = (C & 15) | (A >> 2 & 48)),
+11-17% on the one-row loop in cache and +5-7% streamed (docs/design.md, "Experiments", CPU kernels).
Same 210 bytes per row and super-block, in the order the kernel reads them (a forward stream).
"""
from __future__ import annotations

import torch

from .quant_matmul import FORMATS

ROWS = 8
PACKED = ("Q4_0", "Q5_0", "Q4_K", "Q6_K")  # formats with an interleaved layout (and a kernel for it)


def _fields(qtype: str, b: torch.Tensor) -> list[torch.Tensor]:
    """b [G, nb, 8 rows, bytes] -> the packed fields in order, each [G, nb, ...] with rows inside."""
    G, nb = b.shape[:2]
    if qtype in ("Q4_0", "Q5_0"):
        qs = b[..., -16:].reshape(G, nb, ROWS, 4, 4).transpose(2, 3)
        return [b[..., 0:2], b[..., 2:6], qs] if qtype == "Q5_0" else [b[..., 0:2], qs]
    if qtype == "Q4_K":
        return [b[..., 0:2], b[..., 2:4],
                b[..., 4:16].reshape(G, nb, ROWS, 3, 4).transpose(2, 3),
                b[..., 16:144].reshape(G, nb, ROWS, 4, 8, 4).permute(0, 1, 3, 4, 2, 5)]
    if qtype == "Q6_K":
        ql = b[..., 0:128].reshape(G, nb, ROWS, 2, 2, 8, 4).permute(0, 1, 3, 5, 4, 2, 6)  # [h, t, c, rows, 4]
        qh = b[..., 128:192].reshape(G, nb, ROWS, 2, 8, 1, 4).permute(0, 1, 3, 4, 5, 2, 6)  # [h, t, 1, rows, 4]
        return [b[..., 208:210], b[..., 192:208].reshape(G, nb, ROWS, 4, 4).transpose(2, 3), torch.cat([ql, qh], 4)]
    raise ValueError(f"no interleaved layout for {qtype}; there is one for {', '.join(PACKED)}")


def packed_bytes(qtype: str, rows: int, cols: int) -> tuple[int, int]:
    """Shape [groups, bytes per group] of a packed [rows, cols] weight."""
    values, nbytes = FORMATS[qtype]
    return -(-rows // ROWS), cols // values * nbytes * ROWS


def pack_x8(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """[N, row_bytes] GGUF rows -> [ceil(N / 8), 8 * row_bytes] interleaved groups (zero rows pad
    the last group; zero bytes are zero blocks)."""
    values, nbytes = FORMATS[qtype]
    N, rb = qweight.shape
    G, nb = -(-N // ROWS), rb // nbytes
    w = torch.cat([qweight, qweight.new_zeros(G * ROWS - N, rb)]) if G * ROWS != N else qweight
    b = w.reshape(G, ROWS, nb, nbytes).transpose(1, 2)  # [G, nb, rows, bytes]
    out = torch.cat([f.reshape(G, nb, -1) for f in _fields(qtype, b)], -1)
    if qtype == "Q6_K":
        out[..., Q6_VALUES:] = _q6_recode(out[..., Q6_VALUES:].reshape(G, nb, 16, 3, 32)).reshape(G, nb, -1)
    return out.reshape(G, nb * nbytes * ROWS)


Q6_VALUES = 144  # where a Q6_K group's value bytes start: after 8 x 2 bytes of d and 8 x 16 of scales


def _q6_recode(v: torch.Tensor) -> torch.Tensor:
    """[..., 3, 32] per (h, t): the file's low-nibble bytes l0 (v_0 | v_2 << 4), l1 (v_1 | v_3 << 4) and
    high bits hb (2 bits per value, v_0 lowest) -> A, B, C (module docstring)."""
    l0, l1, hb = v.unbind(-2)
    a = (l0 & 15) | (hb & 3) << 4 | (hb >> 4 & 3) << 6
    b = (l1 & 15) | (hb >> 2 & 3) << 4 | (hb >> 6) << 6
    return torch.stack([a, b, (l0 >> 4) | (l1 & 0xF0)], -2)


def _q6_decode(v: torch.Tensor) -> torch.Tensor:
    """The inverse of `_q6_recode`."""
    a, b, c = v.unbind(-2)
    hb = (a >> 4 & 3) | (b >> 4 & 3) << 2 | (a >> 6) << 4 | (b >> 6) << 6
    return torch.stack([(a & 15) | (c & 15) << 4, (b & 15) | (c & 0xF0), hb], -2)


def unpack_x8(packed: torch.Tensor, qtype: str, rows: int) -> torch.Tensor:
    """The inverse of `pack_x8`: the first `rows` GGUF rows, byte for byte."""
    _, nbytes = FORMATS[qtype]
    G = packed.shape[0]
    nb = packed.shape[1] // (nbytes * ROWS)
    # the permutation applied to byte indices, inverted with argsort (one index map per format)
    idx = torch.arange(ROWS * nbytes).reshape(1, 1, ROWS, nbytes)
    order = torch.cat([f.reshape(1, 1, -1) for f in _fields(qtype, idx)], -1).reshape(-1)
    b = packed.reshape(G, nb, ROWS * nbytes)
    if qtype == "Q6_K":
        b = torch.cat([b[..., :Q6_VALUES], _q6_decode(b[..., Q6_VALUES:].reshape(G, nb, 16, 3, 32)).reshape(G, nb, -1)], -1)
    b = b[..., torch.argsort(order)]
    return b.reshape(G, nb, ROWS, nbytes).transpose(1, 2).reshape(G * ROWS, nb * nbytes)[:rows]
