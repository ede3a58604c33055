"""llama.cpp as a provider: built from the registry's llama-cpp-python source (its
vendor/llama.cpp), then run on the same GGUF files, prompts and threads as ours, greedy, EOS
ignored. Decode tokens/s come from llama.cpp's own timers (prefill apart):
- `ar`: `llama-completion` (its "eval time" line);
- speculative with the draft, and n-gram drafting: `llama-speculative-simple
  --spec-type draft-simple | ngram-simple` (its "decoded N tokens ... speed" line).

    python bench/peers/llamacpp.py build            # once: ~8 minutes on 2 cores, into build/llama.cpp
    python bench/peers/llamacpp.py run --draft-max 3

`SPECENGINE_ISA=avx2`, the switch that forces our kernels' AVX2 copy, builds and runs llama.cpp for
AVX2 alone too (no AVX-512, no VNNI of either width: an AVX2-only EPYC's instruction set), beside
the native build (`bin-avx2/`), so that a run about AVX2 compares like with like.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "llama.cpp"
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")
ISA = "avx2" if os.environ.get("SPECENGINE_ISA") == "avx2" else "native"
SUFFIX = "" if ISA == "native" else f"-{ISA}"  # of the build's folders and of its make target
BIN = BUILD / f"bin{SUFFIX}"
# llama.cpp's own switches (ggml/CMakeLists.txt): its defaults for this CPU, or AVX2 + FMA + F16C + BMI2 alone
ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"],
             "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
                      "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_BF16=OFF"]}


def source() -> Path:
    """vendor/llama.cpp of the llama-cpp-python source package (downloaded once)."""
    found = sorted(BUILD.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    BUILD.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                    "llama-cpp-python", "-d", str(BUILD)], check=True)
    with tarfile.open(next(BUILD.glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(BUILD, filter="data")
    return sorted(BUILD.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


# GCC 12's _tile_loadconfig declares an 8-byte memory operand, so the compiler drops the stores that fill
# ggml's tile configuration (ggml-cpu/amx/mmq.cpp) and the first tile instruction faults (SIGILL, seen
# on a Sapphire Rapids VM at any batch > 1). Built by GCC 12, llama.cpp leaves its AMX path out; its
# other CPU paths, the repacked ones included, stay. Our own kernel loads the configuration with inline
# asm instead (csrc/cpu/amx_impl.h).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def gcc_major() -> int:
    """The C++ compiler's GCC major version (99: not GCC, e.g. clang)."""
    macros = subprocess.run(["c++", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True).stdout
    found = {p[1]: p[2] for p in (line.split(None, 2) for line in macros.splitlines()) if len(p) == 3}
    return 99 if "__clang__" in found else int(found.get("__GNUC__", 99))


def build() -> Path:
    """The tools for `ISA` (llama.cpp's defaults for this CPU, GGML_NATIVE, or AVX2 alone), no network
    features, into `BIN`."""
    src = source()
    out = BIN
    if all((out / t).exists() for t in TOOLS):
        return out
    cmake = src / f"build{SUFFIX}"
    flags = [f"-DCMAKE_{lang}_FLAGS={NO_AMX}" for lang in ("C", "CXX")] if gcc_major() <= 12 else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(cmake), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", *ISA_FLAGS[ISA], *flags], check=True)
    subprocess.run(["cmake", "--build", str(cmake), "-j2", "--target", *TOOLS], check=True)
    out.mkdir(exist_ok=True)
    for t in TOOLS:
        (out / t).unlink(missing_ok=True)
        (out / t).symlink_to(cmake / "bin" / t)
    return out


def version() -> str:
    src = source()
    built = f", built for {ISA} alone" if SUFFIX else ""
    return src.parents[1].name.removeprefix("llama_cpp_python-") + f" (llama-cpp-python; its vendor/llama.cpp{built})"


def require() -> None:
    """A clear stop, before any model loads, where the tools for `ISA` were not built."""
    missing = [t for t in TOOLS if not (BIN / t).exists()]
    if missing:
        isa, env = (f" for {ISA}", f"SPECENGINE_ISA={ISA} ") if SUFFIX else ("", "")
        raise SystemExit(f"llama.cpp is not built{isa} ({BIN / missing[0]} is missing): run `{env}python "
                         f"bench/peers/llamacpp.py build` first (`make bench-gguf{SUFFIX}` does)")


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess:
    require()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def ar(target: Path, prompt: str, n: int, threads: int) -> dict:
    proc = run_tool([str(BIN / "llama-completion"), "-m", str(target), "-p", prompt, "-n", str(n),
                 "-t", str(threads), "--temp", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt"])
    text = proc.stdout + proc.stderr
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", text.split("prompt eval time")[-1])
    p = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
    info = re.search(r"system_info: (.*)", text)  # the instruction sets its kernels were built for
    decode_s, prefill_s = float(m.group(1)) / 1e3, float(p.group(1)) / 1e3 if p else None
    return {"decode_tokens_per_s": int(m.group(2)) / decode_s,
            "prefill_tokens_per_s": int(p.group(2)) / prefill_s if p else None,
            # its own timers' prompt and generation (load apart), as ours count a call's prefill
            "end_to_end_tokens_per_s": int(m.group(2)) / (decode_s + prefill_s) if p else None,
            "system_info": info.group(1).strip() if info else None,
            "text": proc.stdout}  # the greedy continuation, for token agreement with ours


def constrained(target: Path, prompt: str, schema: dict, n: int, threads: int) -> dict:
    """llama.cpp's structured output: `--json-schema` (its grammar from the schema), greedy, up to EOS
    (whole replies, as bench/structured.py runs ours). The prompt is already chat-formatted."""
    proc = run_tool([str(BIN / "llama-completion"), "-m", str(target), "-p", prompt, "-n", str(n),
                     "-t", str(threads), "--temp", "0", "-no-cnv", "--no-display-prompt", "-j", json.dumps(schema)])
    text = proc.stdout + proc.stderr
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", text.split("prompt eval time")[-1])
    p = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
    return {"new_tokens": int(m.group(2)), "decode_s": float(m.group(1)) / 1e3,
            "prefill_s": float(p.group(1)) / 1e3 if p else 0.0, "text": proc.stdout.replace("[end of text]", "").strip()}


def speculative(target: Path, draft: Path | None, prompt: str, n: int, threads: int, kind: str,
                draft_max: int, extra: list[str] = ()) -> dict:
    """extra: more llama-speculative-simple options (e.g. an n-gram drafter's sizes)."""
    cmd = [str(BIN / "llama-speculative-simple"), "-m", str(target), "-p", prompt, "-n", str(n),
           "-t", str(threads), "--temp", "0", "--ignore-eos", "--spec-type", kind, *extra]
    if draft is not None:  # the n-gram drafter keeps its own defaults
        cmd += ["-md", str(draft), "--spec-draft-n-max", str(draft_max)]
    proc = run_tool(cmd)
    text = proc.stdout + proc.stderr
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    acc = re.search(r"accept\s*=\s*([\d.]+)%", text)
    return {"decode_tokens_per_s": int(dec.group(1)) / float(dec.group(2)),
            "prefill_tokens_per_s": int(enc.group(1)) / float(enc.group(2)) if enc else None,
            "end_to_end_tokens_per_s": int(dec.group(1)) / (float(dec.group(2)) + float(enc.group(2))) if enc else None,
            "acceptance": float(acc.group(1)) / 100 if acc else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=3)
    args = ap.parse_args(argv)
    if args.what == "build":
        print(build())
        return 0
    from specengine.models.gguf_weights import gguf_file
    from specengine.prompts import humaneval

    t, d = gguf_file(args.target), gguf_file(args.draft)
    prompt = humaneval(1)[0]["prompt"]
    out = {"ar": ar(t, prompt, args.max_new_tokens, args.threads),
           "draft": speculative(t, d, prompt, args.max_new_tokens, args.threads, "draft-simple", args.draft_max),
           "ngram": speculative(t, None, prompt, args.max_new_tokens, args.threads, "ngram-simple", args.draft_max)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
