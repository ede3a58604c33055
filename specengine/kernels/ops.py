"""The ops table: which implementation every op takes in one engine, decided by one switch.

`kernels` (an `EngineConfig` field) is "auto" | "torch" | "triton" | "cpu", optionally with
per-op overrides: "triton,attention=torch", or a mapping {"default": ..., "attention": ...}.
auto takes the Triton kernel on CUDA (where Triton is installed); on CPU, the compiled CPU op
where the extension has one (the fused step's add_rms_norm, rope_kv_write, silu_and_mul:
csrc/fused_ops_cpu.cpp; the per-row attention at decode and verify widths), else the torch
reference. On CPU tensors a Triton kernel runs only
under Triton's interpreter (TRITON_INTERPRET=1, set before import), which is how the tests
compare both paths without a GPU.

`resolve` turns the switch into an `Ops` once per runner (its device); the runner hands it
to every forward of its model (the fused-step ops and the attention) and the Engine hands
its samplers to the methods (MethodContext). Batch-invariant mode picks its attention from
the same table (`invariant_attentions`). Each op's reference and kernel live in its own file
here; this module only chooses.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..errors import SpecEngineError
from . import add_rms_norm, commit_tokens, cpu_ext, draft_sampling, fused_linear, rejection_sampling, rope_kv_write, \
    row_attention, silu_and_mul, verify_attention
from .jit import HAVE_TRITON

CHOICES = ("auto", "torch", "triton", "cpu")
# op -> (its module, the torch reference's name, the kernel launcher's name)
CPU_OPS = ("attention", "add_rms_norm", "rope_kv_write", "silu_and_mul")  # compiled: `<op>_cpu` in its file
CPU_HOME = {"attention": row_attention}  # where an op's `<op>_cpu` lives when not in its own file
OPS = {
    "attention": (verify_attention, "verify_attention_ref", "verify_attention"),
    "add_rms_norm": (add_rms_norm, "add_rms_norm_ref", "add_rms_norm"),
    "rope_kv_write": (rope_kv_write, "rope_kv_write_ref", "rope_kv_write"),
    "silu_and_mul": (silu_and_mul, "silu_and_mul_ref", "silu_and_mul"),
    "rejection_sample": (rejection_sampling, "rejection_sample_ref", "rejection_sample"),
    "draft_sample": (draft_sampling, "draft_sample_ref", "draft_sample"),
    "commit_tokens": (commit_tokens, "commit_tokens_ref", "commit_tokens"),
    # few-row linears fused with the norm or silu-mul before them; the decoder asks `kernel("gemv")`
    # and runs its fused layer program on all three launchers (the reference: the unfused program)
    "gemv": (fused_linear, "norm_linear_ref", "norm_linear"),
}
# ops whose "auto" stays the reference on CUDA too: gemv's kernel wins or loses against cuBLAS by shape
# and GPU, so Engine.warmup() times both per model and switches a runner (runtime/kernel_choice.py)
AUTO_REFERENCE = ("gemv",)


class KernelChoiceError(SpecEngineError):
    """A `kernels` value that names no choice, no op, or a kernel this machine cannot run (the
    error names the option, so the config and the runners pass it on as it is)."""

    def __init__(self, message: str):
        super().__init__(message, "kernels")


@dataclass(frozen=True)
class Ops:
    """One function per op (the contracts in each op's file) and which one it is."""
    attention: Callable
    add_rms_norm: Callable
    rope_kv_write: Callable
    silu_and_mul: Callable
    rejection_sample: Callable
    draft_sample: Callable
    commit_tokens: Callable
    gemv: Callable  # add + RMSNorm + linear; kernel("gemv"): the decoder's fused layer program (fused_linear.py)
    names: Mapping[str, str]  # op -> "torch" | "triton" | "cpu" (attention: "torch-tiled" | ... when invariant)

    def kernel(self, op: str) -> bool:
        """Whether `op` takes the Triton kernel."""
        return self.names[op].startswith("triton")

    def with_attention(self, fn: Callable, name: str) -> "Ops":
        """This table with another attention (batch-invariant mode's)."""
        return dataclasses.replace(self, attention=fn, names={**self.names, "attention": name})

    def invariant_attentions(self) -> list[tuple[Callable, str]]:
        """Batch-invariant attentions this table allows, fastest first: the fixed-split kernel
        when attention takes Triton, else the compiled per-row CPU attention where it is built;
        last the fixed-tile torch reference."""
        tiled = (verify_attention.verify_attention_tiled, "torch-tiled")
        if self.names["attention"] == "triton":
            return [(verify_attention.verify_attention_fixed, "triton-fixed"), tiled]
        if row_attention._EXT is not None:
            return [(row_attention.verify_attention_rows, "cpu-rows"), tiled]
        return [tiled]


def parse(spec) -> dict[str, str]:
    """op -> "auto" | "torch" | "triton" for every op, from a `kernels` value."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        default = parts[0] if parts and "=" not in parts[0] else "auto"
        pairs = dict(p.split("=", 1) for p in parts if "=" in p)
        spec = {"default": default, **{k.strip(): v.strip() for k, v in pairs.items()}}
        if any("=" not in p for p in parts[1:]):
            raise KernelChoiceError(f"kernels {','.join(parts)!r}: only the first item may be a bare choice; "
                                    "the rest are op=choice")
    if not isinstance(spec, Mapping):
        raise KernelChoiceError(f"kernels must be one of {', '.join(CHOICES)}, 'choice,op=choice,...' or a "
                                f"mapping of ops to choices, got {spec!r}")
    unknown = sorted(set(spec) - set(OPS) - {"default"})
    if unknown:
        raise KernelChoiceError(f"kernels: unknown op {unknown[0]!r}; ops are {', '.join(OPS)} (and 'default')")
    out = {op: spec.get(op, spec.get("default", "auto")) for op in OPS}
    for op, choice in out.items():
        if choice not in CHOICES:
            raise KernelChoiceError(f"kernels: {op}={choice!r}; choose from {', '.join(CHOICES)}")
    return out


def cpu_available(op: str) -> bool:
    """Whether op has a compiled CPU version in this build."""
    if op == "attention":  # its compiled op is named row_attention (kernels/row_attention.py)
        return row_attention._EXT is not None
    return op in CPU_OPS and cpu_ext.op(op) is not None


def resolve(spec, device: torch.device | str = "cpu") -> Ops:
    """The table for `kernels` = spec on `device` (a kernel asked for where it cannot run is
    refused here, naming why, never at the first forward). "cpu" for an op without a compiled
    version is its torch reference, as "triton" is for ops without a kernel."""
    device = torch.device(device)
    names = {}
    for op, choice in parse(spec).items():
        if choice == "auto":
            choice = ("triton" if HAVE_TRITON and op not in AUTO_REFERENCE else "torch") if device.type == "cuda" else \
                ("cpu" if cpu_available(op) else "torch")
        elif choice == "triton":
            if not HAVE_TRITON:
                raise KernelChoiceError(f"kernels: {op}='triton' needs Triton: pip install 'specengine[triton]'")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise KernelChoiceError(f"kernels: {op}='triton' needs a CUDA device (or TRITON_INTERPRET=1, set "
                                        f"before import, to run kernels on CPU tensors)")
        elif choice == "cpu":
            if device.type != "cpu":
                raise KernelChoiceError(f"kernels: {op}='cpu' runs on CPU tensors, and this engine is on {device}")
            if cpu_ext.EXT is None:
                raise KernelChoiceError(f"kernels: {op}='cpu' needs the compiled extension, which this install "
                                        "lacks (reinstall with a C++ compiler: make install)")
            choice = choice if cpu_available(op) else "torch"
        names[op] = choice
    fns = {op: getattr(CPU_HOME.get(op, module), f"{op}_cpu") if names[op] == "cpu" else
           getattr(module, kernel if names[op] == "triton" else ref) for op, (module, ref, kernel) in OPS.items()}
    return Ops(**fns, names=names)


TORCH = resolve("torch")  # every reference: the CPU path, and the model's default
