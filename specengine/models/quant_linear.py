"""Linear and embedding layers whose weights stay GGUF blocks (kernels/quant_matmul.py).

`QuantLinear` holds one or more row segments, each a uint8 tensor [rows, row_bytes] of one
block format (a merged projection whose checkpoint parts differ in format keeps a segment
per part: Q4_K_M files store some v / down projections as Q6_K). On CPU it runs the
compiled kernel (`specengine._quantext`: the activations quantized per block to int8 as
llama.cpp does, each weight block unpacked once and multiplied with every activation row as
integers; reference `quant_matmul_q8_ref`) where it is built, else the float torch reference;
the result comes back in the activation dtype. A segment may be held interleaved 8 rows at a time
(`pack`, csrc/cpu/x8_layout.h: the same bytes reordered, which the kernel reads about twice as fast
for Q4_K); quant_plan.choose_layouts decides per shape by measuring. `QuantEmbedding` dequantizes
only the rows a step reads.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.jit import HAVE_TRITON
from ..kernels.quant_matmul import CODES, FORMATS, dequantize_ref, quant_matmul_ref, quant_matmul_triton
from ..kernels.quant_pack import PACKED, pack_x8, unpack_x8

# the one place the extension loads (None: the torch reference), and its formats' codes
from ..kernels.cpu_ext import EXT as _quantext, EXT_CODES

if _quantext is not None:  # as torch ops, so torch.compile traces through them (no graph break)
    @torch.library.custom_op("specengine::dequantize", mutates_args=())
    def _dequantize(w: torch.Tensor, code: int, cols: int) -> torch.Tensor:
        return _quantext.dequantize(w, code, cols)

    @_dequantize.register_fake
    def _(w, code, cols):
        return w.new_empty(w.shape[0], cols, dtype=torch.float32)

    @torch.library.custom_op("specengine::quant_matmul", mutates_args=())
    def _int8_matmul(x: torch.Tensor, w: torch.Tensor, code: int) -> torch.Tensor:
        return _quantext.quant_matmul(x, w, code)

    @_int8_matmul.register_fake
    def _(x, w, code):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.custom_op("specengine::quant_matmul_x8", mutates_args=())
    def _x8_matmul(x: torch.Tensor, w: torch.Tensor, code: int, rows: int) -> torch.Tensor:
        return _quantext.quant_matmul_x8(x, w, code, rows)

    @_x8_matmul.register_fake
    def _(x, w, code, rows):
        return x.new_empty(x.shape[0], rows)

    @torch.library.custom_op("specengine::dense_matmul", mutates_args=())
    def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """fp32 [M, N] = x [M, K] fp32 @ w [N, K] (bf16 / fp32).T, each weight row read once."""
        return _quantext.dense_matmul(x, w)

    @dense_matmul.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])


def extension_isa() -> str | None:
    """The instruction set the compiled kernel runs with here (CPUID), or None when not built."""
    return _quantext.isa() if _quantext is not None else None


_LAYOUT_LISTENERS = []  # called after every layout change: they drop what cached the old tensors


def on_layout_change(fn) -> None:
    """Call fn() after every QuantLinear layout change, pack or unpack (models/cpu_stack.py drops its
    stacks, which hold the old tensors)."""
    _LAYOUT_LISTENERS.append(fn)


def _layout_changed() -> None:
    for fn in _LAYOUT_LISTENERS:
        fn()


def quant_matmul(x2: torch.Tensor, qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """fp32 [M, N] = x2 [M, K] @ dequantize(qweight).T, on the fastest path available here. On CPU
    the compiled int8 kernel at every width, so decode, verify and prefill (whole or in chunks, as
    the serving core's prefix reuse runs it) give a row the same bits. It is also the fastest there:
    dequantizing a weight for BLAS costs more than the int8 kernel's whole product up to 512 rows and
    beyond (docs/design.md, "Experiments": Q4_K 17920 x 1536 at 512 rows, 59 ms interleaved vs 209 ms, on the
    2-core AMD EPYC). On a GPU the Triton kernel (fp32 accumulation; batch invariance there is the
    probe's business)."""
    if qweight.is_cuda and HAVE_TRITON and qtype in CODES:  # GPU: the Triton kernel, any row count
        return quant_matmul_triton(x2, qweight, qtype)
    if _quantext is None or qweight.device.type != "cpu" or qtype not in EXT_CODES:
        return quant_matmul_ref(x2, qweight, qtype)
    # eager calls go straight to the extension: the custom op's wrapper costs ~14 us a call, ~1.8 ms
    # of a 28-layer decode step; torch.compile traces the op
    matmul = _int8_matmul if torch.compiler.is_compiling() else _quantext.quant_matmul
    return matmul(x2.float().contiguous(), qweight, EXT_CODES[qtype])


def quant_matmul_packed(x2: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int) -> torch.Tensor:
    """`quant_matmul` on a weight interleaved by `pack_x8` (CPU with the extension; anywhere else
    through the file's layout again)."""
    if _quantext is None or packed.device.type != "cpu":
        return quant_matmul(x2, unpack_x8(packed, qtype, rows), qtype)
    matmul = _x8_matmul if torch.compiler.is_compiling() else _quantext.quant_matmul_x8
    return matmul(x2.float().contiguous(), packed, EXT_CODES[qtype], rows)


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W as GGUF blocks: `segments` [(qtype, uint8 [rows, row_bytes])] stacked
    along the output dimension; `parts` as `decoder.Linear`'s (the checkpoint projections merged)."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]], bias: torch.Tensor | None = None, parts: tuple = ()):
        super().__init__()
        self.parts, self.qtypes = parts, [q for q, _ in segments]
        widths = set()
        for i, (q, w) in enumerate(segments):
            if q not in FORMATS:
                raise ValueError(f"unsupported GGUF block format {q!r}")
            values, nbytes = FORMATS[q]
            widths.add(w.shape[1] // nbytes * values)  # a row's bytes give its values
            self.register_buffer(f"qweight{i}", w.contiguous())
        self.packed = [None] * len(segments)  # per segment: its row count while held interleaved
        if len(widths) != 1:
            raise ValueError(f"segments of one layer must hold rows of one width, got {sorted(widths)}")
        self.in_features = widths.pop()
        self.out_features = sum(w.shape[0] for _, w in segments)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def segments(self):
        """[(qtype, uint8 [rows, row_bytes])] in the file's layout (an interleaved segment unpacked: a copy)."""
        return [(q, w if n is None else unpack_x8(w, q, n)) for (q, w), n in zip(self.stored(), self.packed)]

    def stored(self):
        """[(qtype, the tensor as held)]: the file's rows, or interleaved groups where `packed`."""
        return [(q, getattr(self, f"qweight{i}")) for i, q in enumerate(self.qtypes)]

    def pack(self, interleave: bool = True) -> None:
        """Hold every segment whose format has an interleaved kernel (kernels/quant_pack.PACKED) as
        interleaved groups (interleave=False: back to the file's rows)."""
        for i in range(len(self.qtypes)):
            self.pack_segment(i, interleave)

    def pack_segment(self, i: int, interleave: bool = True) -> None:
        q, w = self.stored()[i]
        if interleave and self.packed[i] is None and q in PACKED:
            self.packed[i] = w.shape[0]
            setattr(self, f"qweight{i}", pack_x8(w, q))
            _layout_changed()
        elif not interleave and self.packed[i] is not None:
            setattr(self, f"qweight{i}", unpack_x8(w, q, self.packed[i]))
            self.packed[i] = None
            _layout_changed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        outs = [quant_matmul(x2, w, q) if n is None else quant_matmul_packed(x2, w, q, n)
                for (q, w), n in zip(self.stored(), self.packed)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (tests and conversions; never on the decode path)."""
        return torch.cat([dequantize_ref(w, q) for q, w in self.segments()])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={self.qtypes}"


def quant_layers(model) -> list["QuantLinear"]:
    """The model's layers held as GGUF blocks (none: a float model)."""
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


class QuantEmbedding(nn.Module):
    """Token embeddings as GGUF blocks [vocab, row_bytes]; a lookup dequantizes its rows only."""

    def __init__(self, qtype: str, qweight: torch.Tensor, dim: int, dtype: torch.dtype):
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype = qtype, dim, dtype
        self.register_buffer("qweight", qweight.contiguous())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        picked = self.qweight[tokens.reshape(-1)]
        if _quantext is not None and picked.device.type == "cpu" and self.qtype in EXT_CODES:  # the same values
            rows = _dequantize(picked, EXT_CODES[self.qtype], self.embedding_dim)
        else:
            rows = dequantize_ref(picked, self.qtype)
        return rows.to(self.dtype).reshape(*tokens.shape, self.embedding_dim)
