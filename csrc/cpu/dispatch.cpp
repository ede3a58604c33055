// The one dispatch of the CPU kernels (llama.cpp's ggml-cpu picks its backend the same way): every copy
// this CPU runs, widest first by CPUID, the one the kernels run with (`kernels()`), and the tests'
// switch to another (`set_isa`). The copies themselves: isa_*.cpp.
#include "common.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace se {
namespace {

// AMX-INT8 in CPUID, and Linux lets this process use tile data (ARCH_REQ_XCOMP_PERM: the tiles' 8 KiB of
// state are opt-in per process; a VM can also withhold them). Asked once.
[[maybe_unused]] bool amx_usable() {
#if defined(SPECENGINE_X86) && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Every copy this CPU runs, widest first (CPUID): never a per-machine constant.
std::vector<Kernels> runnable() {
  std::vector<Kernels> out;
#ifdef SPECENGINE_X86
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  (void)avx512;
  // (a copy is compiled only where the build machine runs it, or with SPECENGINE_ISAS=all: setup.py)
#ifdef SE_BUILT_VNNI
  if (avx512 && __builtin_cpu_supports("avx512vnni")) {
    out.push_back(vnni_kernels());
    // the tile copy: the same bits, faster or not at prefill widths by machine, so never the default;
    // the planner measures it once per machine and sets it (specengine/models/quant_plan.py, choose_tiles)
    if (amx_usable()) out.push_back(amx_kernels());
  }
#endif
#ifdef SE_BUILT_AVX512
  if (avx512)
    out.push_back(avx512_kernels());
#endif
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    out.push_back(avx2_kernels());
#endif
  out.push_back(baseline_kernels());
  return out;
}

}  // namespace

Kernels& kernels() {
  static Kernels chosen = runnable().front();
  return chosen;
}

std::string isa_name() { return kernels().isa; }

// Run with another copy this CPU supports (tests compare every copy with the reference).
void set_isa(const std::string& name) {
  std::string known;
  for (const auto& k : runnable()) {
    if (name == k.isa) {
      kernels() = k;
      return;
    }
    known += std::string(known.empty() ? "" : ", ") + k.isa;
  }
  TORCH_CHECK(false, "this CPU cannot run the '", name, "' kernels; it can run: ", known);
}

std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const auto& k : runnable()) out.push_back(k.isa);
  return out;
}

}  // namespace se
