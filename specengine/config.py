"""`EngineConfig`: every Engine option written once, with its default, its check and its help.

`Engine(...)` / `Engine.from_pretrained(...)` take these as keyword arguments (or a config),
the CLI derives its engine flags from the fields (cli.py), and the serving core reads its
defaults here. Checks that need the models (a draft for the method, vocabularies, the
target's sliding window) stay with the Engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .methods.ngram_index import check_sizes as check_ngram_sizes
from .errors import SpecEngineError
from .methods import METHODS
from .methods.policies import make_policy
from .models.loading import WEIGHTS
from .kernels.ops import parse as parse_kernels
from .runtime.invariance import check_options as check_invariant_options

WEIGHT_CHOICES = ("auto", *WEIGHTS)  # auto: blocks or float per model, measured (pair.py)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def option(default, help: str, **cli):
    """A config field: its default, its help text, and how the CLI reads it (`cli`: `type`, a
    parser, default int for an int default else str; `choices`, CLI word -> value). A field
    whose default is True becomes a --no-... switch."""
    return field(default=default, metadata={"help": help, **cli})


def parse_gamma(text: str):
    """A --gamma value: 'auto' or an integer (CLI and demo)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise SpecEngineError(f"gamma must be an integer or 'auto', got {text!r}", "gamma") from None


def _positive_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SpecEngineError(f"{name} must be an integer >= {least}, got {value!r}", name)


@dataclass(frozen=True)
class EngineConfig:
    method: str | None = option(None, "ar | sd | pearl | parallelspec | ngram | hybrid (default: sd with a draft "
                                "model, ngram with draft='ngram', else ar)")
    max_seq_len: int = option(2048, "KV capacity per row: prompt + new tokens + speculation headroom")
    gamma: int | str = option("auto", "sd: draft tokens per round, or auto (chosen each round from measured costs "
                              "and acceptance); pearl: window (default round(1/c), measured); parallelspec: k",
                              type=parse_gamma)
    policy: str = option("fixed", "sd draft-length policy: fixed | heuristic | confidence | specdec++")
    threshold: float | None = option(None, "confidence / specdec++ stopping threshold (default: the policy's)",
                                     type=float)
    kernels: object = option("auto", "every op's implementation: auto (Triton kernels on CUDA, torch references "
                             "elsewhere) | torch | triton, then optional per-op overrides, e.g. "
                             "'triton,attention=torch' (ops: attention, add_rms_norm, rope_kv_write, silu_and_mul, "
                             "rejection_sample, draft_sample, commit_tokens, gemv: few-row linears fused with the norm "
                             "or silu-mul before them, auto = cuBLAS until a GPU times it)")
    cuda_graphs: bool = option(True, "replay CUDA graphs for every step (--no-cuda-graphs: run eagerly)")
    cpu_matmul: str = option("auto", "auto (fastest path per weight shape, measured once per machine) | linear")
    max_batch: int = option(1, "largest batch CUDA graphs are captured for (the server's rows)")
    acceptance_head: object = option(None, "specdec++ head file (default: the one shipped for the draft, if any)")
    parallel_drafter: object = option(None, "parallelspec drafter file (default: the one shipped for the draft)")
    batch_invariant: bool | str = option(
        "auto", "fixed-tile attention, and target forwards padded to one width where a start-up probe finds the "
        "kernels depend on the row count: speculation token-exact with ar in bf16/fp16 too (auto: on for 16-bit "
        "targets when it costs <= 5% per decode here)", choices={"off": False, "on": True, "auto": "auto"})
    invariant_width: int = option(9, "widest target forward the batch-invariant mode covers")
    ngram_max: int = option(3, "ngram: the longest suffix matched against the row's own text (transformers' "
                            "max_matching_ngram_size)")
    ngram_min: int = option(1, "ngram: the shortest suffix that counts as a match")
    suffix_cache_tokens: int = option(100_000, "suffix decoding: tokens of earlier responses remembered per key (API "
                                      "key on the server), oldest evicted first")
    draft_vocab: int | str = option(
        "auto", "the draft's LM head over only this many of the most frequent tokens (FR-Spec: a cheaper draft "
        "step; outputs unchanged, the draft just never proposes the rest): auto (65536 where a shipped frequency "
        "table fits the tokenizer and that halves the head or more), 0 (the full head), or a number",
        type=lambda t: t if t == "auto" else int(t))
    huge_pages: bool = option(True, "hold CPU weights in 2 MiB pages (Linux transparent huge pages): fewer TLB "
                              "misses as each step streams the weights, 1.1-1.2x decode on a 2-core VM; the pages' "
                              "first touch costs load time (8-10 s per GiB measured on a VM whose host reclaims "
                              "freed memory, 0.15 on pages the process had just freed): --no-huge-pages for "
                              "short-lived processes there")
    # loading: read by Engine.from_pretrained (an Engine built from loaded models ignores them)
    device: str = option("auto", "auto (CUDA when available) | cpu | cuda | cuda:N")
    dtype: object = option("auto", "auto (bf16 on CUDA; on CPU fp32 or bf16, whichever measures faster) | "
                           "float32 | bfloat16 | float16")
    draft_device: str | None = option(None, "put the draft on its own device, e.g. cuda:1 (PEARL on two GPUs)")
    weights: str = option("auto", "gguf (keep a GGUF file's quantized blocks; dtype is then the activation dtype) "
                          "| float (dequantize once) | auto (with dtype auto on a CPU and a GGUF source: blocks or "
                          "float per model, whichever the measured plan predicts faster; else float)", choices={w: w for w in WEIGHT_CHOICES})

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise SpecEngineError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}", "method")
        _positive_int("max_seq_len", self.max_seq_len, 2)
        _positive_int("max_batch", self.max_batch, 1)
        check_invariant_options(self.batch_invariant, self.invariant_width)
        if self.cpu_matmul not in ("auto", "linear"):
            raise SpecEngineError(f"unknown cpu_matmul mode {self.cpu_matmul!r}; choose from auto, linear",
                                  "cpu_matmul")
        parse_kernels(self.kernels)  # a KernelChoiceError names the option
        if self.weights not in WEIGHT_CHOICES:
            raise SpecEngineError(f"unknown weights {self.weights!r}; choose from {', '.join(WEIGHT_CHOICES)}",
                                  "weights")
        if not isinstance(self.dtype, torch.dtype) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise SpecEngineError(f"unknown dtype {self.dtype!r}; choose from auto, {', '.join(DTYPES)}", "dtype")
        make_policy(self.policy, self.gamma, threshold=self.threshold)  # the draft-length options, early
        check_ngram_sizes(self.ngram_max, self.ngram_min)
        if self.draft_vocab != "auto":
            _positive_int("draft_vocab", self.draft_vocab, 0)

    def replace(self, **options) -> "EngineConfig":
        """This config with `options` changed (validated); unknown names are refused."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - names)
        if set(unknown) & {"attention_backend", "sampler_backend"}:
            raise SpecEngineError("attention_backend and sampler_backend are one option now: kernels=... "
                                  "(e.g. kernels='torch', or kernels='auto,attention=torch')", "kernels")
        if unknown:
            raise SpecEngineError(f"unknown engine option {unknown[0]!r}; choose from {', '.join(sorted(names))}",
                                  unknown[0])
        return dataclasses.replace(self, **options) if options else self

    def torch_dtype(self) -> torch.dtype | None:
        """The dtype asked for, or None for "auto" (measured at load)."""
        return None if self.dtype == "auto" else self.dtype if isinstance(self.dtype, torch.dtype) \
            else DTYPES[self.dtype]
