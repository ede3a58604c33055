"""GGUF blocks interleaved 8 rows at a time (csrc/cpu/x8_layout.h, its kernels x8_impl.h): the layout
is a byte permutation (Q6_K's values also recoded) that gives the file's rows back exactly; the kernel on it, in every
instruction-set copy this CPU runs, equals the reference of the file's layout (odd row counts, a
partial last group, 1-17 activation rows) and gives each row the same bits whatever rows share its
call; quantized layers hold it and compute the same; the layout is chosen by measurement and never
taken by a tensor the embedding shares."""
import pytest
import torch

from ops.test_quant_matmul import random_blocks
from specengine.kernels.quant_matmul import FORMATS, dequantize_ref, quant_matmul_q8_ref
from specengine.kernels.quant_pack import PACKED, ROWS, pack_x8, packed_bytes, unpack_x8
from specengine.models import cpu_matmul, quant_linear, quant_plan
from specengine.models.quant_linear import EXT_CODES, QuantEmbedding, QuantLinear


@pytest.mark.parametrize("qtype", PACKED)
@pytest.mark.parametrize("N", [1, 7, 8, 9, 17])
def test_packing_is_a_permutation_the_file_rows_come_back_from(qtype, N):
    w = random_blocks(qtype, N, 512, seed=N)
    p = pack_x8(w, qtype)
    assert tuple(p.shape) == packed_bytes(qtype, N, 512) == (-(-N // ROWS), 512 // FORMATS[qtype][0] * FORMATS[qtype][1] * ROWS)
    assert torch.equal(unpack_x8(p, qtype, N), w)
    if qtype != "Q6_K":  # Q6_K's values are recoded bit by bit (checked value by value below)
        # the same bytes (and zero rows up to the group): a permutation, nothing lost or made up
        padded = torch.cat([w, w.new_zeros(p.shape[0] * ROWS - N, w.shape[1])])
        assert torch.equal(p.flatten().sort().values, padded.flatten().sort().values)


def test_the_layout_puts_each_rows_scale_where_the_kernel_reads_it():
    """Spot checks of the documented byte positions (independent of `_fields`)."""
    w = random_blocks("Q4_K", 8, 256, seed=1)
    p = pack_x8(w, "Q4_K")[0]
    for r in range(8):
        assert torch.equal(p[2 * r:2 * r + 2], w[r, 0:2])  # d
        assert torch.equal(p[16 + 2 * r:18 + 2 * r], w[r, 2:4])  # dmin
        assert torch.equal(p[32 + 32 + 4 * r:32 + 36 + 4 * r], w[r, 8:12])  # scale word 1
        assert torch.equal(p[128 + 256 * 3 + 32 * 5 + 4 * r:128 + 256 * 3 + 32 * 5 + 4 * r + 4],
                           w[r, 16 + 32 * 3 + 4 * 5:16 + 32 * 3 + 4 * 5 + 4])  # qs chunk c 3, t 5
    w6 = random_blocks("Q6_K", 8, 256, seed=2)
    p6 = pack_x8(w6, "Q6_K")[0].tolist()
    for r in range(8):
        row = w6[r].tolist()
        assert p6[2 * r:2 * r + 2] == row[208:210]
        assert p6[16 + 32 * 3 + 4 * r:16 + 32 * 3 + 4 * r + 4] == row[192 + 12:192 + 16]  # scales 12-15
        # the 256 six-bit values as GGUF's dequantize_row_q6_K reads them (ql, qh), in plain Python
        v = [0] * 256
        for h in range(2):
            ql, qh = row[64 * h:64 * h + 64], row[128 + 32 * h:128 + 32 * h + 32]
            for j in range(32):
                v[128 * h + j] = (ql[j] & 15) | (qh[j] & 3) << 4
                v[128 * h + 32 + j] = (ql[32 + j] & 15) | (qh[j] >> 2 & 3) << 4
                v[128 * h + 64 + j] = (ql[j] >> 4) | (qh[j] >> 4 & 3) << 4
                v[128 * h + 96 + j] = (ql[32 + j] >> 4) | (qh[j] >> 6) << 4
        for h, t, b in [(0, 0, 0), (1, 7, 3), (0, 5, 2), (1, 2, 1)]:
            at = 144 + 96 * (8 * h + t) + 4 * r + b
            A, B, C = p6[at], p6[at + 32], p6[at + 64]
            vk = [v[128 * h + 32 * k + 4 * t + b] for k in range(4)]
            assert (A & 63, B & 63) == (vk[0], vk[1])
            assert ((A >> 6) << 4 | (C & 15), (B >> 6) << 4 | (C >> 4)) == (vk[2], vk[3])


def test_the_q5_0_layout_keeps_high_bits_whole_and_steps_of_value_bytes():
    w = random_blocks("Q5_0", 8, 64, seed=4)  # two blocks
    p = pack_x8(w, "Q5_0")[0]
    for r in range(8):
        at = 176  # block 1
        assert torch.equal(p[at + 2 * r:at + 2 * r + 2], w[r, 22:24])  # d
        assert torch.equal(p[at + 16 + 4 * r:at + 20 + 4 * r], w[r, 24:28])  # the 32 high bits
        assert torch.equal(p[at + 48 + 32 * 3 + 4 * r:at + 52 + 32 * 3 + 4 * r], w[r, 22 + 6 + 12:22 + 6 + 16])  # t 3


def test_the_simd_copies_of_the_interleaved_kernel_agree_bit_for_bit():
    """AVX2, AVX-512, the 512-bit VNNI loops (csrc/cpu/x8_zmm_impl.h) and, where the CPU has AMX, the
    tile loop (csrc/cpu/amx_impl.h: Q4_K's full 16-row chunks, here rows 0-31, the rest vector)
    form the same integer sums and take the same float steps, so a machine's choice among them never
    changes a token. The plain C++ copy follows dot_rows' float order instead (checked against the
    reference above)."""
    ext = quant_linear._quantext
    simd = [i for i in ext.isas() if i != "baseline"]  # one copy on an AVX2-only CPU: nothing to compare
    widest = ext.isa()
    try:
        for qtype in PACKED:
            w, x = pack_x8(random_blocks(qtype, 37, 768, seed=1), qtype), torch.randn(35, 768)
            outs = []
            for isa in simd:
                ext.set_isa(isa)
                outs.append(ext.quant_matmul_x8(x, w, EXT_CODES[qtype], 37))
            assert all(torch.equal(o, outs[0]) for o in outs), qtype
    finally:
        ext.set_isa(widest)


def test_formats_without_a_layout_are_refused():
    with pytest.raises(ValueError, match="no interleaved layout for Q8_0"):
        pack_x8(random_blocks("Q8_0", 8, 64), "Q8_0")


@pytest.mark.parametrize("qtype", PACKED)
@pytest.mark.parametrize("N,K,M", [(37, 512, 1), (3, 256, 5), (70, 768, 9), (16, 1024, 17)])
def test_interleaved_kernel_equals_the_reference_within_fp32_rounding(ext, qtype, N, K, M):
    w = random_blocks(qtype, N, K, seed=N * M + 7)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    scale = float((x.abs() @ dequantize_ref(w, qtype).abs().T).max())
    got = ext.quant_matmul_x8(x, pack_x8(w, qtype), EXT_CODES[qtype], N)
    torch.testing.assert_close(got, quant_matmul_q8_ref(x, w, qtype), rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("qtype", PACKED)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_interleaved_kernel_is_exact_at_the_largest_integer_sums(ext, qtype, sign):
    """Every value at its format's maximum, the signed Q6_K scales at +127 / -128 and activations
    that quantize to +-127 throughout: the integer sums the SIMD loops pack into int16 (4 products
    of 63 x 127) and accumulate are at their largest, and must still be the reference's exactly."""
    from ops.test_quant_matmul import SCALES
    w = torch.full((19, 512 // FORMATS[qtype][0], FORMATS[qtype][1]), 0xFF, dtype=torch.uint8)
    for at in SCALES[qtype]:
        w[..., at:at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if qtype == "Q6_K":
        w[..., 192:208:2], w[..., 193:208:2] = 0x7F, 0x80
    w = w.reshape(19, -1).contiguous()
    x = torch.full((9, 512), sign)
    x[:, 256:] *= torch.tensor([1.0, -1.0]).repeat(128)  # the second super-block with mixed signs
    scale = float((x.abs() @ dequantize_ref(w, qtype).abs().T).max())
    got = ext.quant_matmul_x8(x, pack_x8(w, qtype), EXT_CODES[qtype], 19)
    torch.testing.assert_close(got, quant_matmul_q8_ref(x, w, qtype), rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("qtype", PACKED)
def test_interleaved_rows_do_not_depend_on_their_neighbours(ext, qtype):
    w = pack_x8(random_blocks(qtype, 21, 512, seed=3), qtype)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(4))
    together = ext.quant_matmul_x8(x, w, EXT_CODES[qtype], 21)
    for m in range(13):
        assert torch.equal(ext.quant_matmul_x8(x[m:m + 1].contiguous(), w, EXT_CODES[qtype], 21)[0], together[m])
    assert torch.equal(ext.quant_matmul_x8(x[2:7].contiguous(), w, EXT_CODES[qtype], 21), together[2:7])


def test_interleaved_kernel_refuses_bad_inputs_naming_them():
    ext = quant_linear._quantext
    w = pack_x8(random_blocks("Q4_K", 9, 256), "Q4_K")
    with pytest.raises(RuntimeError, match=r"interleaved groups for 17 rows"):
        ext.quant_matmul_x8(torch.zeros(1, 256), w, EXT_CODES["Q4_K"], 17)
    with pytest.raises(RuntimeError, match="no interleaved layout for GGUF block format code 2"):
        ext.quant_matmul_x8(torch.zeros(1, 256), w, EXT_CODES["Q8_0"], 9)
    # the packer and unpacker the layout is defined by (csrc/cpu/x8_layout.h), bound as they are
    with pytest.raises(RuntimeError, match="no interleaved layout for GGUF block format code 2"):
        ext.pack_x8(random_blocks("Q8_0", 8, 64), EXT_CODES["Q8_0"])
    with pytest.raises(RuntimeError, match=r"\[N, row_bytes\] of Q4_K blocks"):
        ext.pack_x8(torch.zeros(8, 100, dtype=torch.uint8), EXT_CODES["Q4_K"])
    with pytest.raises(RuntimeError, match="holding the 17 rows asked for"):
        ext.unpack_x8(w, EXT_CODES["Q4_K"], 17)


@pytest.mark.parametrize("rows", [1, 5, 80])  # decode, verify, prefill (through the file's layout)
def test_a_packed_layer_computes_what_it_did_and_gives_its_blocks_back(rows):
    segs = [("Q4_K", random_blocks("Q4_K", 19, 512, seed=1)), ("Q8_0", random_blocks("Q8_0", 5, 512, seed=2)),
            ("Q6_K", random_blocks("Q6_K", 6, 512, seed=3))]
    layer = QuantLinear(segs, torch.randn(30))
    x = torch.randn(1, rows, 512, generator=torch.Generator().manual_seed(rows))
    before = layer(x)
    layer.pack()
    assert layer.packed == [19, None, 6]  # Q8_0 has no interleaved layout: kept as rows
    scale = float((x.abs() @ layer.dequantized().abs().T).max())
    torch.testing.assert_close(layer(x), before, rtol=0, atol=2e-6 * scale)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(layer.segments(), segs))
    layer.pack(False)
    assert layer.packed == [None] * 3 and all(torch.equal(a[1], b[1]) for a, b in zip(layer.stored(), segs))


class Tiny(torch.nn.Module):
    """A model with a head tied to its embedding and a separate projection."""

    def __init__(self):
        super().__init__()
        emb = random_blocks("Q4_K", 12, 256, seed=5)
        self.embed_tokens = QuantEmbedding("Q4_K", emb, 256, torch.float32)
        self.lm_head = QuantLinear([("Q4_K", emb)])
        self.proj = QuantLinear([("Q4_K", random_blocks("Q4_K", 24, 256, seed=6))])


@pytest.mark.parametrize("faster", ["x8", "rows"])
def test_the_measured_faster_layout_is_taken_and_a_tied_head_is_left_alone(monkeypatch, faster):
    table = {}
    monkeypatch.setattr(cpu_matmul, "_load_table", lambda: table)
    monkeypatch.setattr(cpu_matmul, "_save_table", lambda t: None)
    model = Tiny()
    quant_plan.choose_layouts(model, reps=1, progress=False)  # measured: one entry, for the proj shape
    (key, entry), = [(k, v) for k, v in table.items() if k != quant_plan.TILES_ENTRY]  # AMX: the copy's choice too
    assert key.endswith(":layout:Q4_K:24x256") and set(entry["ms"]) == {str(r) for r in quant_plan.LAYOUT_ROWS}
    slow = "rows" if faster == "x8" else "x8"
    for ms in entry["ms"].values():  # pretend this machine measured `faster` as the faster one
        ms[faster], ms[slow] = 1.0, 2.0
    assert quant_plan.choose_layouts(model, progress=False) == {"Q4_K:24x256": faster}
    assert model.proj.packed == ([24] if faster == "x8" else [None])
    assert model.lm_head.packed == [None]  # shares the embedding's blocks
    cpu_matmul.unpack(model)
    assert model.proj.packed == [None]
