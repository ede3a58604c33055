"""Build hook for the optional compiled extensions (csrc/): `specengine._kvext` (KV compaction)
and `specengine._quantext` (matmul with GGUF-quantized weights, CPU).

The package imports and works without it (torch index ops are the fallback), so the build
never breaks an install: it is skipped when torch is not importable at build time (pip's
build isolation) or no compiler is found, and a failed compile is reported and skipped.
SPECENGINE_BUILD_EXT=0 skips it, =1 forces it (a failure is then an error). The CUDA part
is added only with nvcc and a CUDA build of torch; TORCH_CUDA_ARCH_LIST picks the archs (with
no GPU to ask, as when the CUDA build PyPI serves lands on a CPU machine with nvcc: 8.0 and 9.0,
the archs the kernels are checked for). Each extension is built or skipped on its own, so a CUDA
failure never costs the CPU kernels. Metadata lives in pyproject.toml.
"""
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

MODE = os.environ.get("SPECENGINE_BUILD_EXT", "auto")  # auto | 0 | 1


def build_cache():
    """tools/ext_build_cache.py, loaded by path: a module built before with the same inputs is reused.
    None where it is absent (a source tree without tools/): then every build compiles."""
    path = Path(__file__).parent / "tools" / "ext_build_cache.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("ext_build_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def isa_units():
    """The per-ISA copies of the CPU kernels to compile (csrc/cpu/isa_*.cpp) and their macros: baseline
    and avx2 always; avx512 and vnni (which also holds the AMX tile loop) where this CPU runs them, or
    everywhere with SPECENGINE_ISAS=all (a build for other machines). Each copy is a minute of one
    core: an AVX2-only machine, which can run neither, compiles two fewer (dispatch picks among
    the compiled copies by CPUID either way)."""
    want = os.environ.get("SPECENGINE_ISAS", "native")
    if want not in ("native", "all"):
        raise SystemExit(f"SPECENGINE_ISAS must be 'native' or 'all', got {want!r}")
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.M).group(1).split())
    except (OSError, AttributeError):
        flags, want = set(), "all"  # no CPUID flags to read: every copy
    avx512 = want == "all" or {"avx512f", "avx512bw", "avx512vl"} <= flags
    vnni = avx512 and (want == "all" or "avx512_vnni" in flags)
    units = ["csrc/cpu/isa_baseline.cpp", "csrc/cpu/isa_avx2.cpp"]
    units += ["csrc/cpu/isa_avx512.cpp"] * avx512 + ["csrc/cpu/isa_vnni.cpp"] * vnni
    return units, [("SE_BUILT_AVX512", None)] * avx512 + [("SE_BUILT_VNNI", None)] * vnni


def extensions():
    if MODE == "0":
        return {}, []
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        if MODE == "1":
            raise
        print("specengine: torch is not importable at build time; skipping the KV extension "
              "(install with --no-build-isolation to build it)", file=sys.stderr)
        return {}, []
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        if MODE == "1":
            raise RuntimeError("no C++ compiler found")
        print("specengine: no C++ compiler; skipping the KV extension", file=sys.stderr)
        return {}, []
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("SPECENGINE_CUDA", "1") != "0"
    if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch reads the archs from the visible GPUs; with none it failed (IndexError), and the
        # whole build with it, the CPU kernels included (CUDA torch + nvcc on a CPU machine)
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    sources = ["csrc/compact_kv.cpp"]
    # no -std flag: BuildExtension adds the standard this torch was built with
    # -g0: Python's own flags ask for debug info (-g), which doubled the compile of the templated
    # kernels (isa_avx2.cpp 102 -> 53 s on a 2-core EPYC) and is never read
    args = {"cxx": ["-O3", "-g0"]}
    if with_cuda:
        sources.append("csrc/compact_kv_cuda.cu")
        args["nvcc"] = ["-O3"]
        ext = CUDAExtension("specengine._kvext", sources, extra_compile_args=args, define_macros=[("WITH_CUDA", None)])
    else:
        ext = CppExtension("specengine._kvext", sources, extra_compile_args=args)

    class OptionalBuild(BuildExtension):
        failed = frozenset()  # the extensions whose build failed (auto mode)

        def run(self):
            try:
                super().run()
            except Exception as e:  # never break the install in auto mode
                if MODE == "1":
                    raise
                print(f"specengine: building the extensions failed ({e}); using the torch fallbacks",
                      file=sys.stderr)

        def build_extension(self, ext):  # one extension's failure leaves the other built
            cache, target = build_cache(), self.get_ext_fullpath(ext.name)
            key = cache and cache.key(ext, torch.__version__, CUDA_HOME if with_cuda else None)
            if cache and cache.fetch(key, target):
                return
            try:
                super().build_extension(ext)
            except Exception as e:
                if MODE == "1":
                    raise
                self.failed = self.failed | {ext.name}
                print(f"specengine: building {ext.name} failed ({e}); using its torch fallback", file=sys.stderr)
                return
            if cache:
                cache.keep(key, target)

        def build_extensions(self):  # then only what was built is copied in place or installed
            super().build_extensions()
            self.extensions = [e for e in self.extensions if e.name not in self.failed]

    # the quantized matmul: CPU only; its hot loops carry per-ISA clones chosen by CPUID at load
    # -fopenmp: at::parallel_for is OpenMP inline in ATen's headers (without it, one thread); the
    # runtime is torch's own libgomp.so.1 (same soname)
    # one translation unit per instruction set (csrc/cpu/isa_*.cpp): with ninja (the Makefile installs
    # it) BuildExtension compiles them in parallel, MAX_JOBS at a time (default: every core)
    cpu, macros = isa_units()
    # -Wno-psabi: the baseline copy, built at -O1 (isa_baseline.cpp), calls silu_impl.h's 64-byte
    # vector helpers instead of inlining them, and GCC notes that such a call's ABI changed in GCC 4.6
    # (helpers of one translation unit: no ABI is crossed)
    quant = CppExtension("specengine._quantext", ["csrc/quant_matmul.cpp", "csrc/fused_ops_cpu.cpp", "csrc/decode_stack.cpp",
                                                  "csrc/cpu/dispatch.cpp", *cpu], define_macros=macros,
                         extra_compile_args={"cxx": ["-O3", "-g0", "-fopenmp", "-Wno-psabi"]}, extra_link_args=["-fopenmp"])
    return {"build_ext": OptionalBuild.with_options(no_python_abi_suffix=False)}, [ext, quant]


cmdclass, ext_modules = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
