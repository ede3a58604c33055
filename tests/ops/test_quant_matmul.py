"""GGUF blocks kept as they are (kernels/quant_matmul.py, csrc/quant_matmul.cpp): the torch
dequantizers equal the `gguf` package's bit for bit on every format; the compiled CPU kernel, in
every instruction-set copy this CPU runs, equals its reference (activations quantized per block,
times the dequantized weights; odd shapes, 1-70 rows), which stays within int8 rounding of the
plain float matmul, and gives each row the same bits whatever rows share its call; the quantized
layers compute what their dequantized weights would."""
import numpy as np
import pytest
import torch

from specengine.kernels.quant_matmul import (FORMATS, dequantize_ref, quant_matmul_q8_ref, quant_matmul_ref,
                                             quantize_rows_ref, row_bytes)
from specengine.models import quant_linear
from specengine.models.quant_linear import EXT_CODES, QuantEmbedding, QuantLinear

SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF rows: random quants, finite positive fp16 scales where each block keeps them."""
    g = torch.Generator().manual_seed(seed)
    values, nbytes = FORMATS[qtype]
    b = torch.randint(0, 256, (rows, cols // values, nbytes), generator=g, dtype=torch.uint8)
    for at in SCALES[qtype]:
        d = (torch.rand(rows, cols // values, generator=g) * 0.02 + 0.001).half()
        b[..., at:at + 2] = d.view(torch.uint8).reshape(rows, cols // values, 2)
    return b.reshape(rows, -1).contiguous()


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_reference_dequantizer_equals_the_gguf_package(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = random_blocks(qtype, 9, 512, seed=len(qtype))
    theirs = dequantize(w.numpy(), GGMLQuantizationType[qtype]).reshape(9, 512)
    assert torch.equal(dequantize_ref(w, qtype), torch.from_numpy(np.ascontiguousarray(theirs)))


def test_the_kernels_format_table_is_the_references_and_ggufs():
    """csrc/cpu/common.h holds the compiled kernels' one table of block formats; Python reads it
    from the binding. Each entry's block size must be the reference's and the gguf package's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from specengine import _quantext

    table = _quantext.formats()
    assert set(table) == {"Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} and EXT_CODES == {n: c for n, (c, _, _) in
                                                                                             table.items()}
    for name, (code, values, nbytes) in table.items():
        assert FORMATS[name] == (values, nbytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name]], name
    assert sorted(c for c, _, _ in table.values()) == list(range(len(table)))


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="not a multiple"):
        row_bytes("Q4_K", 300)
    with pytest.raises(ValueError, match="unsupported GGUF block format 'Q3_K'"):
        dequantize_ref(torch.zeros(2, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="whole blocks of 144 bytes"):
        dequantize_ref(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")


def test_the_kernel_is_built_here():
    """CI builds it (make install); without it the quantized layers fall back to the reference."""
    assert quant_linear.extension_isa() in ("avx512amx", "avx512vnni", "avx512", "avx2", "baseline")


def test_every_copy_the_cpu_runs_is_offered():
    """The widest copy runs, or on a CPU with AMX tiles whichever of the two the planner measured faster
    (quant_plan.choose_tiles, run by any earlier GGUF engine of this process)."""
    from specengine.kernels.cpu_ext import TILES, VECTOR

    ext = quant_linear._quantext
    assert ext.isas()[-1] == "baseline"
    assert ext.isa() == ext.isas()[0] or (ext.isa() == TILES and ext.isas()[0] == VECTOR)
    with pytest.raises(RuntimeError, match="cannot run the 'sve' kernels"):
        ext.set_isa("sve")


def test_spec_engine_isa_runs_the_copy_it_names_and_refuses_one_not_offered(monkeypatch):
    """SPECENGINE_ISA (kernels/cpu_ext.forced_isa): the named copy runs, and the machine table's key
    names it (its measurements are filed apart); a name the build does not offer is refused."""
    from specengine import SpecEngineError, machine
    from specengine.kernels import cpu_ext

    ext, widest = quant_linear._quantext, quant_linear._quantext.isa()
    monkeypatch.delenv(cpu_ext.FORCE_ENV, raising=False)
    assert cpu_ext.forced_isa() is None and ext.isa() == widest
    try:
        monkeypatch.setenv(cpu_ext.FORCE_ENV, "baseline")
        assert cpu_ext.forced_isa() == "baseline" and ext.isa() == "baseline"
        assert machine.machine()["kernels"] == "baseline"
    finally:
        ext.set_isa(widest)
    monkeypatch.setenv(cpu_ext.FORCE_ENV, "avx3")
    with pytest.raises(SpecEngineError, match="SPECENGINE_ISA='avx3'.*offer .*baseline"):
        cpu_ext.forced_isa()
    assert ext.isa() == widest


def test_activations_are_quantized_per_block_half_to_even():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5] + [0.0] * 28, [0.0] * 32])
    q, d = quantize_rows_ref(x, 32)
    assert q[0, :4].tolist() == [127, -64, 0, 2] and d[0, 0] == 1.0
    assert not q[1].any() and d[1, 0] == 0  # an all-zero block stays zero, no division by zero


@pytest.mark.parametrize("qtype", list(EXT_CODES))
@pytest.mark.parametrize("N,K,M", [(37, 512, 1), (3, 256, 5), (70, 768, 9), (5, 1024, 17)])
def test_kernel_equals_its_reference_within_fp32_rounding(ext, qtype, N, K, M):
    w = random_blocks(qtype, N, K, seed=N * M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    scale = float((x.abs() @ dequantize_ref(w, qtype).abs().T).max())  # the largest sum of |terms|
    got = ext.quant_matmul(x, w, EXT_CODES[qtype])
    torch.testing.assert_close(got, quant_matmul_q8_ref(x, w, qtype), rtol=0, atol=1e-6 * scale)
    # and the int8 activations stay close to the float matmul (llama.cpp's approximation)
    torch.testing.assert_close(got, quant_matmul_ref(x, w, qtype), rtol=0, atol=3e-3 * scale)
    assert torch.equal(ext.dequantize(w, EXT_CODES[qtype], K), dequantize_ref(w, qtype))


@pytest.mark.parametrize("qtype", list(EXT_CODES))
def test_a_rows_result_does_not_depend_on_its_neighbours(ext, qtype):
    """Batch invariance: a decode (1 row) and a verify (k rows) give a row the same bits."""
    w = random_blocks(qtype, 33, 768, seed=3)
    x = torch.randn(13, 768, generator=torch.Generator().manual_seed(4))  # chunks 8 + 5, or 4 + 4 + 4 + 1
    together = ext.quant_matmul(x, w, EXT_CODES[qtype])
    for m in range(13):
        assert torch.equal(ext.quant_matmul(x[m:m + 1].contiguous(), w, EXT_CODES[qtype])[0], together[m])
    assert torch.equal(ext.quant_matmul(x[2:7].contiguous(), w, EXT_CODES[qtype]), together[2:7])


def test_kernel_refuses_bad_inputs_naming_them():
    ext = quant_linear._quantext
    w = random_blocks("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        ext.quant_matmul(torch.zeros(1, 32), w, EXT_CODES["Q8_0"])
    with pytest.raises(RuntimeError, match="float32"):
        ext.quant_matmul(torch.zeros(1, 64, dtype=torch.float64), w, EXT_CODES["Q8_0"])
    with pytest.raises(RuntimeError, match="unknown GGUF block format code"):
        ext.quant_matmul(torch.zeros(1, 64), w, 9)


@pytest.mark.parametrize("rows", [1, 5, 80])  # decode, verify, prefill: the int8 kernel's arithmetic at every width
def test_quant_linear_with_mixed_format_segments_is_its_dequantized_linear(rows):
    q = random_blocks("Q4_K", 24, 256, seed=1)
    k = random_blocks("Q4_K", 8, 256, seed=2)
    v = random_blocks("Q6_K", 8, 256, seed=3)
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(40, generator=g)
    layer = QuantLinear([("Q4_K", torch.cat([q, k])), ("Q6_K", v)], bias)
    dense = torch.cat([dequantize_ref(q, "Q4_K"), dequantize_ref(k, "Q4_K"), dequantize_ref(v, "Q6_K")])
    x = torch.randn(1, rows, 256, generator=g)
    want = torch.cat([quant_matmul_q8_ref(x, torch.cat([q, k]), "Q4_K"), quant_matmul_q8_ref(x, v, "Q6_K")], -1)
    scale = float((x.abs() @ dense.abs().T).max())
    torch.testing.assert_close(layer(x), want + bias, rtol=0, atol=1e-5 * scale)
    assert layer(x.bfloat16()).dtype == torch.bfloat16 and torch.equal(layer.dequantized(), dense)


def test_quant_linear_reads_its_width_from_the_blocks_and_refuses_ragged_segments():
    assert QuantLinear([("Q6_K", random_blocks("Q6_K", 4, 512))]).in_features == 512
    with pytest.raises(ValueError, match="rows of one width"):
        QuantLinear([("Q4_K", random_blocks("Q4_K", 4, 256)), ("Q8_0", random_blocks("Q8_0", 4, 512))])


def test_quant_embedding_dequantizes_the_rows_it_reads():
    w = random_blocks("Q5_0", 50, 64, seed=5)
    emb = QuantEmbedding("Q5_0", w, 64, torch.float32)
    tokens = torch.tensor([[3, 49, 3], [0, 7, 12]])
    assert torch.equal(emb(tokens), dequantize_ref(w, "Q5_0")[tokens])


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,M", [(37, 77, 1), (19, 256, 5), (40, 1000, 9)])
def test_dense_few_row_kernel_is_the_matmul_and_batch_invariant(ext, wdtype, N, K, M):
    """The bf16 / fp32 few-row kernel (a CPU matmul plan candidate, path `rows`): the fp64 product
    within fp32 rounding (odd K: the tail past the 16-lane body), each row's bits independent of
    the rows beside it."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).to(wdtype)
    x = torch.randn(M, K, generator=g)
    got = ext.dense_matmul(x, w)
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float((x.abs() @ w.float().abs().T).max()))
    for m in range(M):
        assert torch.equal(ext.dense_matmul(x[m:m + 1].contiguous(), w)[0], got[m])
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ext.dense_matmul(x, w.half())


@pytest.mark.parametrize("lines", [1, 3, 4097])
def test_read_stream_reads_every_byte_once(lines):
    """The bandwidth probe of `bench/gguf_cpu.py --streams`: its checksum is the XOR of every 8-byte
    word (so no line is skipped or read twice), and it refuses what is not whole lines."""
    ext = quant_linear._quantext
    buf = torch.randint(0, 256, (lines * 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(lines))
    words = buf.view(torch.int64)
    expect = 0
    for w in words.tolist():
        expect ^= w
    assert ext.read_stream(buf) == expect
    with pytest.raises(RuntimeError, match="whole 64-byte lines"):
        ext.read_stream(buf[:63])
