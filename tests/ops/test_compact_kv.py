"""compact_kv: the compiled extension and the torch fallback against a naive
gather-then-scatter, bit for bit; bad input; CUDA kernel and graph replay on GPU."""
import pytest
import torch

from specengine import SpecEngineError
from specengine.runtime.kv_compact import compact_kv, compact_kv_ref, extension_available

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def naive(kv, src_pos, dst_start, count):
    out = kv.clone()
    S = kv.shape[3]
    for b in range(kv.shape[2]):
        c, d = int(count[b]), int(dst_start[b])
        pairs = [(int(src_pos[b, i]), d + i) for i in range(c)]
        pairs = [(s, t) for s, t in pairs if 0 <= s < S and 0 <= t < S]
        vals = [kv[:, :, b, s].clone() for s, _ in pairs]  # gather first
        for (_, t), v in zip(pairs, vals):
            out[:, :, b, t] = v
    return out


def case(dtype, device="cpu", L=3, B=4, S=40, H=2, D=8, N=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, 2, B, S, H, D, generator=g).to(device, dtype)
    # row 0: path inside the region it is compacted into (overlap), row 1: count 0,
    # row 2: scattered sources with -1 padding, row 3: descending sources overlapping dst
    src = torch.full((B, N), -1, dtype=torch.int64)
    src[0, :4] = torch.tensor([20, 22, 23, 27])
    src[2, :3] = torch.tensor([5, 31, 12])
    src[3, :5] = torch.tensor([14, 13, 12, 11, 10])
    dst = torch.tensor([20, 7, 30, 11], dtype=torch.int32)
    cnt = torch.tensor([4, 0, 3, 5], dtype=torch.int32)
    return kv, src.to(device), dst.to(device), cnt.to(device)


def test_extension_is_built_in_the_test_environment():
    assert extension_available(), "make test builds csrc/ (pip install --no-build-isolation -e .)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_bit_exact_against_gather_then_scatter(dtype, backend):
    kv, src, dst, cnt = case(dtype)
    expected = naive(kv, src, dst, cnt)
    compact_kv(kv, src, dst, cnt, backend=backend)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_ext_and_fallback_agree(seed):
    g = torch.Generator().manual_seed(seed)
    L, B, S, H, D, N = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                        ((1, 5), (1, 6), (8, 64), (1, 4), (1, 65), (1, 9)))
    kv = torch.randn(L, 2, B, S, H, D, generator=g)
    cnt = torch.randint(0, N + 1, (B,), generator=g, dtype=torch.int32)
    dst = torch.stack([torch.randint(0, S - int(c) + 1, (1,), generator=g) for c in cnt]).view(B).to(torch.int32)
    src = torch.stack([torch.randperm(S, generator=g)[:N] for _ in range(B)])
    src[torch.arange(N)[None, :] >= cnt[:, None]] = -1
    expected = naive(kv, src, dst, cnt)
    a, b = kv.clone(), kv.clone()
    compact_kv(a, src, dst, cnt, backend="ext")
    compact_kv_ref(b, src, dst, cnt)
    assert torch.equal(a, expected) and torch.equal(b, expected)


def test_bad_input_gives_clear_errors():
    kv, src, dst, cnt = case(torch.float32)
    with pytest.raises(SpecEngineError, match="kv_buffer must be"):
        compact_kv(kv[0], src, dst, cnt)
    with pytest.raises(SpecEngineError, match="dtype must be"):
        compact_kv(kv.to(torch.float64), src, dst, cnt)
    with pytest.raises(SpecEngineError, match="src_pos must be int64"):
        compact_kv(kv, src.to(torch.int32), dst, cnt)
    with pytest.raises(SpecEngineError, match="count must be int32"):
        compact_kv(kv, src, dst, cnt[:2])
    with pytest.raises(SpecEngineError, match="dst_start must be int32"):
        compact_kv(kv, src, dst.to(torch.int64), cnt)
    bad = src.clone()
    bad[0, 1] = 400
    with pytest.raises(SpecEngineError, match="outside"):
        compact_kv(kv, bad, dst, cnt)
    with pytest.raises(SpecEngineError, match="dst_start \\+ count"):
        compact_kv(kv, src, torch.tensor([38, 0, 0, 0], dtype=torch.int32), cnt)
    with pytest.raises(SpecEngineError, match="count must be in"):
        compact_kv(kv, src, dst, torch.tensor([9, 0, 0, 0], dtype=torch.int32))
    before = kv.clone()
    with pytest.raises(SpecEngineError, match="unknown compact_kv backend"):
        compact_kv(kv, src, dst, cnt, backend="cuda")
    assert torch.equal(kv, before)  # nothing moved on an error


def test_unchecked_out_of_range_indices_never_write_out_of_bounds():
    kv, src, dst, cnt = case(torch.float32)
    src[0, 1] = 10_000
    expected = naive(kv, src, dst, cnt)  # skips the bad slot
    for backend in ("ext", "torch"):
        got = kv.clone()
        compact_kv(got, src, dst, cnt, backend=backend, check=False)
        assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not extension_available(), reason="the KV extension is not built (scripts/gpu_check.sh's "
                    "install builds it and fails loudly without it; SPECENGINE_BUILD_EXT=0 skips it)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_and_graph_replay(dtype):
    kv, src, dst, cnt = case(dtype, "cuda", L=4, B=4, S=64, H=2, D=128)
    expected = naive(kv.cpu(), src.cpu(), dst.cpu(), cnt.cpu())
    eager = kv.clone()
    compact_kv(eager, src, dst, cnt, backend="ext", check=False)
    assert torch.equal(eager.cpu(), expected)
    static = kv.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the capture
        compact_kv(static.clone(), src, dst, cnt, backend="ext", check=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv(static, src, dst, cnt, backend="ext", check=False)
    static.copy_(kv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.cpu(), expected)


needs_nvcc = pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
def test_kernel_alone_keeps_its_buffer_out_of_local_memory(tmp_path):
    """The device code alone, every cache dtype and buffer size, for sm_90 and sm_80: no
    stack frame, no spills (a per-thread array indexed at run time would live in local memory)."""
    import subprocess
    from pathlib import Path

    from helpers.repo_tools import load_tool

    ext_check = load_tool("ext_check")
    parse_ptxas, torch_cxx_standard = ext_check.parse_ptxas, ext_check.torch_cxx_standard

    std = torch_cxx_standard(Path(torch.__file__).parent)
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    sig = "const int64_t*, const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t"
    src = tmp_path / "k.cu"
    src.write_text("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include \"compact_kv_kernel.cuh\"\n" + "".join(
        f"template __global__ void compact_kv_kernel<{t}, {n}, compact_kv_threads<{t}, {n}>()>({t}*, {sig});\n"
        for t in ("float", "__half", "__nv_bfloat16", "double") for n in (16, 64, 256)))
    for arch in ("90", "80"):
        r = subprocess.run(["nvcc", "-cubin", str(src), f"-I{csrc}", "-o", str(tmp_path / "k.cubin"), f"-std={std}",
                            "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        usage = parse_ptxas(r.stdout + r.stderr)
        assert len(usage) == 12
        for k in usage:
            assert k.stack_bytes == 0 and k.spill_bytes == 0, (arch, k)
            assert 0 < k.shared_bytes <= 48 * 1024, (arch, k)  # static shared memory limit


@needs_nvcc
@pytest.mark.slow  # ~1-2 minutes of nvcc: in the last tier (conftest.py)
def test_extension_cuda_source_compiles_against_cuda_torch_headers():
    """csrc/compact_kv_cuda.cu as the real build compiles it: torch's CUDA headers, torch's
    C++ standard (from its build config) and nvcc flags, sm_90. `make test` extracts the
    headers of a CUDA torch wheel first (tools/ext_check.py --fetch-only); without them
    this skips. A compile of the very same inputs is remembered (tools/ext_check._memo_path)."""
    from helpers.repo_tools import load_tool

    ext_check = load_tool("ext_check")
    compile_cuda, cuda_torch_root = ext_check.compile_cuda, ext_check.cuda_torch_root

    root = cuda_torch_root()
    if root is None:
        pytest.skip("no CUDA torch headers (python tools/ext_check.py --fetch-only)")
    std, usage = compile_cuda(root, "90")
    assert std in ("c++17", "c++20", "c++23")
    names = {k.name for k in usage}
    assert any("BFloat16" in n for n in names) and any("Half" in n for n in names), names
    for k in usage:
        assert k.stack_bytes == 0 and k.spill_bytes == 0, k


def test_setup_py_follows_torchs_cxx_standard():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert "-std=" not in text  # BuildExtension adds the standard torch was built with
