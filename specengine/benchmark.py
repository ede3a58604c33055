"""End-to-end benchmark: several providers side by side in one run, on HumanEval prompts.

Providers: `ar`, `sd`, `sd:<gamma>`, `sd:auto`, `sd[:<gamma>]@<policy>[=<threshold>]` (e.g.
`sd@heuristic`, `sd:8@specdec++=0.6`), `pearl[:<gamma>]` (ours), `hf` (transformers generate,
target alone) and `hf-assisted` (transformers generate with assistant_model=draft). Every provider
generates exactly `max_new_tokens` per prompt (EOS ignored) so rates compare like with
like; `speedup` is relative to the named baseline measured in the same run.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .machine import cpuinfo, machine
from .models.cpu_matmul import matvec_bound
from .errors import SpecEngineError
from .prompts import humaneval
from .request import RequestParams

HF_PROVIDERS = ("hf", "hf-assisted", "hf-lookup")  # hf-lookup: generate(prompt_lookup_num_tokens=10)
TREE_METHODS = ("sd", "parallelspec", "ngram", "suffix")
AUTO_METHODS = ("sd", "ngram", "hybrid", "suffix", "hybrid-suffix")  # take gamma "auto" in a provider name
GAMMA_METHODS = ("sd", "pearl", "parallelspec", *AUTO_METHODS[1:])  # take an integer gamma


def parse_provider(spec: str) -> tuple[str, int | str | None, str | None, float | None, str | None]:
    """-> (method, gamma, policy, threshold, tree); `sd:3@specdec++=0.5` -> ("sd", 3, "specdec++", 0.5, None),
    `sd[tree=4x5:16]` -> ("sd", None, None, None, "4x5:16")."""
    spec, tree = _split_tree(spec)
    if tree is not None:
        name, *rest = parse_provider(spec)
        if name not in TREE_METHODS or any(x is not None for x in rest[:-1]):
            raise SpecEngineError(f"bad provider {spec}[tree=...]: only plain {', '.join(TREE_METHODS)} take a tree")
        return name, None, None, None, tree
    head, _, pol = spec.partition("@")
    name, _, g = head.partition(":")
    if name not in ("ar", *GAMMA_METHODS, *HF_PROVIDERS):
        raise SpecEngineError(f"unknown provider {spec!r}; use ar, sd[:gamma|:auto][@policy[=threshold]], "
                              "pearl[:gamma][@parallel], parallelspec[:k], ngram[:gamma|:auto], "
                              "hybrid[:gamma|:auto], suffix[:gamma|:auto], hybrid-suffix[:gamma|:auto], hf, "
                              "hf-assisted, hf-lookup")
    policy, _, th = pol.partition("=")
    if pol and not (name == "sd" or (name, pol) == ("pearl", "parallel")):
        raise SpecEngineError(f"bad provider {spec!r}: only sd takes a policy (e.g. sd@heuristic); pearl takes "
                              "@parallel (the ParallelSpec drafter)")
    try:
        threshold = float(th) if th else None
    except ValueError:
        raise SpecEngineError(f"bad provider {spec!r}: threshold must be a number") from None
    if g == "auto" and name in AUTO_METHODS:
        return name, g, policy or None, threshold, None
    if g and (name not in GAMMA_METHODS or not g.isdigit() or int(g) < 1):
        raise SpecEngineError(f"bad provider {spec!r}: only {', '.join(GAMMA_METHODS)} take a gamma, e.g. sd:4")
    return name, int(g) if g else None, policy or None, threshold, None


def _split_tree(spec: str) -> tuple[str, str | None]:
    if not spec.endswith("]"):
        return spec, None
    head, sep, tail = spec[:-1].partition("[tree=")
    if not sep or not tail:
        raise SpecEngineError(f"bad provider {spec!r}: a tree is written sd[tree=KxD:N]")
    return head, tail


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=False).stdout.strip()
    except OSError:
        return ""


def forcing_env() -> list[str]:
    """The settings that change what runs, as the command's prefix (`SPECENGINE_ISA=avx2 bench/...`)."""
    from . import precision
    from .kernels import cpu_ext
    from .models import requant

    return [f"{k}={os.environ[k]}" for k in (cpu_ext.FORCE_ENV, precision.FORCE_ENV, requant.ENV) if os.environ.get(k)]


def environment() -> dict:
    commit = _git("rev-parse", "--short", "HEAD") or None
    if commit and _git("status", "--porcelain", "--untracked-files=no", "--", ":/specengine", ":/csrc", ":/bench",
                       ":(exclude,top)bench/results"):
        commit += "-dirty"  # the run's code differs from that commit (tracked files changed; results are not code)
    import transformers

    cpu = machine()
    commit = os.environ.get("SPECENGINE_COMMIT") or commit  # set by gpu_check: a copied tree's .git may be stale
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu": cpu["cpu"], "cpu_family_model": f"{cpuinfo('cpu family')}/{cpuinfo('model')}",
           "cpu_isa": cpu["isa"], "cpu_threads": cpu["threads"], "weight_pages": cpu["pages"],
           "commit": commit, "command": " ".join(forcing_env() + sys.argv)}
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda)
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    else:
        env["device"] = "cpu"
    return env


class _HFRunner:
    """transformers generate on the same converted weights, for the hf/hf-assisted providers."""

    def __init__(self, engine, target_path, draft_path):
        from transformers import AutoModelForCausalLM

        kw = dict(dtype=engine.target.dtype)
        from .models.fetch import ensure_float_weights  # a GGUF's directory holds none until asked

        target_path, draft_path = ensure_float_weights(target_path), draft_path and ensure_float_weights(draft_path)
        self.target = AutoModelForCausalLM.from_pretrained(target_path, **kw).to(engine.device).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft_path, **kw).to(engine.device).eval() \
            if draft_path else None
        for m in (self.target, self.draft):
            if m is not None:  # EOS comes per call: none (ignore_eos on our side) or the engine's set
                m.generation_config.eos_token_id = None

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, provider: str, eos: list[int] | None = None) -> list[int]:
        x = torch.tensor([ids], device=self.target.device)
        kw = {"hf": {}, "hf-assisted": dict(assistant_model=self.draft),
              "hf-lookup": dict(prompt_lookup_num_tokens=10)}[provider]
        out = self.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=eos,
                                   max_new_tokens=max_new_tokens, pad_token_id=0, **kw)
        return out[0, len(ids):].tolist()


def run_benchmark(engine, providers: list[str], n_prompts: int = 8,
                  max_new_tokens: int = RequestParams.max_new_tokens, target_path=None, draft_path=None, baseline: str | None = None, temperature: float = 0.0,
                  seed: int = 0, prompts: tuple[str, list[str]] | None = None, stop_at_eos: bool = False) -> dict:
    """prompts: (a label, the prompt texts) in place of HumanEval[:n_prompts].
    stop_at_eos: every provider stops at the engine's EOS ids (whole replies, as a user gets them);
    by default each generates exactly max_new_tokens.
    temperature > 0: every provider of ours samples with the same seed (tokens then agree
    only where the methods draw the same numbers; speeds and acceptance are what compare).

    Why long: one loop runs every provider (ours and HF's) prompt by prompt, side by side
    (every provider on a prompt before the next prompt, so that a machine whose speed drifts
    during the run weighs on every provider alike), so that their ratios come from one run;
    the report is assembled right there."""
    specs = [(p, *parse_provider(split_vocab(p)[0])) for p in providers]
    if any(name == "hf-assisted" for _, name, *_ in specs) and draft_path is None:
        raise SpecEngineError("hf-assisted needs a draft model")
    if temperature and any(name in HF_PROVIDERS for _, name, *_ in specs):
        raise SpecEngineError("the hf providers are greedy only; drop them for temperature > 0")
    label, prompts = prompts or ("HumanEval[:%d]" % n_prompts, [p["prompt"] for p in humaneval(n_prompts)])
    hf = _HFRunner(engine, target_path, draft_path) if any(n in HF_PROVIDERS for _, n, *_ in specs) else None
    ids = [engine.encode(p)[0][0] for p in prompts]
    siblings = {}  # draft_vocab -> an engine on the same models with the draft's head cut
    runs = {spec: _provider_fn(_with_draft_vocab(engine, split_vocab(spec)[1], siblings), hf, name, gamma, policy,
                               threshold, temperature, seed, tree, stop_at_eos)
            for spec, name, gamma, policy, threshold, tree in specs}
    for run in runs.values():
        run(ids[0], 4)  # warm-up: first-call allocations and library start-up
    timed = {spec: [] for spec in runs}
    for p in tqdm(ids, desc=label, leave=False):
        for spec, run in runs.items():
            t = time.perf_counter()
            toks, stats = run(p, max_new_tokens)
            timed[spec].append((time.perf_counter() - t, toks, stats))
    rows, outputs_of = {}, {}
    for spec, name, gamma, policy, threshold, tree in specs:
        per_prompt = [(w, len(toks), stats) for w, toks, stats in timed[spec]]
        outputs = [toks for _, toks, _ in timed[spec]]
        wall = sum(w for w, _, _ in per_prompt)
        new = sum(n for _, n, _ in per_prompt)
        row = {"provider": spec, "new_tokens": new, "wall_time_s": wall, "tokens_per_s": new / wall}
        ours = [s for _, _, s in per_prompt if s]
        if ours:  # decoding alone (prefill excluded): what the matvec bound speaks about
            row["decode_tokens_per_s"] = new / (wall - sum(s["prefill_s"] for s in ours))
            tf = sum(s["target_forwards"] for s in ours)
            row["tokens_per_target_forward"] = new / tf
            if "acceptance_rate" in ours[0]:
                row["acceptance_rate"] = sum(s["accepted_drafts"] for s in ours) / max(
                    sum(s["proposed_drafts"] for s in ours), 1)
                row["gamma"] = ours[0]["gamma"]
                row["gamma_mean"] = sum(s["gamma_mean"] for s in ours) / len(ours)
                row["policy"] = ours[0]["policy"]
                row["draft_cost_ratio"] = sum(s["draft_cost_ratio"] or 0 for s in ours) / len(ours)
                row["draft_s_per_round"] = sum(s["draft_s"] for s in ours) / max(sum(s["rounds"] for s in ours), 1)
                row["acceptance_by_position"] = _pooled_positions(ours)
            errors = [s["prediction_error"] for s in ours if "prediction_error" in s]
            if errors:  # γ auto: the cost model's tokens/s against the measured decode rate, per prompt
                row["prediction_error"] = statistics.median(errors)  # of two prompts, their mean (not the upper)
                row["predicted_tokens_per_s"] = sum(s["predicted_tokens_per_s"] for s in ours) / len(ours)
                row["plain_rounds"] = sum(s.get("plain_rounds", 0) for s in ours)
            if name == "pearl":
                runs = sum(s["new_tokens"] / s["mean_accepted_tokens"] for s in ours)
                row["mean_accepted_tokens"] = new / runs
                row["measured_cost_ratio"] = ours[0]["measured_cost_ratio"]
                for k in ("round_draft_s", "round_target_s", "round_wall_s"):
                    row[k] = sum(s[k] for s in ours) / len(ours)
        rows[spec], outputs_of[spec] = row, outputs
    # exact match against ar (the target's own greedy tokens, in this dtype), else the first provider
    ref = next((spec for spec, name, *_ in specs if name == "ar"), providers[0])
    for spec, row in rows.items():
        row.update(agreement(outputs_of[spec], outputs_of[ref]))
    base = baseline or providers[0]
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / rows[base]["tokens_per_s"]
    report = {"benchmark": "e2e", "baseline": base, "n_prompts": len(ids), "max_new_tokens": max_new_tokens,
              "stop_at_eos": stop_at_eos,
              "prompts": label, "greedy": not temperature, "temperature": temperature,
              "seed": seed,
              "dtype": str(engine.target.dtype).removeprefix("torch."),
              "dtype_choice": getattr(engine, "dtype_choice", None), "exact_match_reference": ref,
              "batch_invariant": getattr(engine, "batch_invariant_info", None),
              "environment": environment(), "results": list(rows.values()),
              # what a host-only replay of a policy reads: the prompts' ids and the reference's tokens
              "prompt_ids": ids, "reference_outputs": outputs_of[ref]}
    if engine.device.type == "cpu":  # what the memory system allows: weights / measured matvec time
        bound = report["target_matvec_bound"] = matvec_bound(engine.target.model)
        for row in report["results"]:
            if row["provider"] == "ar":
                row["decode_fraction_of_matvec_bound"] = row["decode_tokens_per_s"] / bound["tokens_per_s_bound"]
    return report


def _pooled_positions(stats: list[dict]) -> list[float]:
    """alpha_i over every prompt's rounds: P(draft i accepted | drafts 1..i-1 accepted)."""
    n = max(len(s["reached_by_position"]) for s in stats)
    reached = [sum(s["reached_by_position"][i] for s in stats if i < len(s["reached_by_position"])) for i in range(n)]
    acc = [sum(s["accepted_by_position"][i] for s in stats if i < len(s["accepted_by_position"])) for i in range(n)]
    return [a / r for a, r in zip(acc, reached) if r]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Exact-match rate over prompts and the earliest token index where any prompt differs."""
    firsts = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
              for o, r in zip(outputs, reference) if o != r]
    return {"same_tokens_as_reference": not firsts,
            "exact_match_rate": 1 - len(firsts) / max(len(reference), 1),
            "first_divergence": min(firsts) if firsts else None}


def split_vocab(spec: str) -> tuple[str, int | None]:
    """`sd:auto/vocab=32768` -> ("sd:auto", 32768): the provider on an engine whose draft head
    keeps the 32768 most frequent ids (draft_vocab); no suffix -> (spec, None)."""
    base, sep, k = spec.partition("/vocab=")
    if sep and not k.isdigit():
        raise SpecEngineError(f"bad provider {spec!r}: /vocab= takes a number of token ids, e.g. sd:auto/vocab=32768")
    return base, int(k) if sep else None


def _with_draft_vocab(engine, size: int | None, siblings: dict):
    """engine, or (made once per size) an engine on the same models with draft_vocab=size."""
    if size is None:
        return engine
    if engine.draft is None:
        raise SpecEngineError("a /vocab= provider needs a draft model")
    if size not in siblings:
        from .api import Engine

        siblings[size] = Engine(engine.target.model, engine.tokenizer, engine.draft.model,
                                engine.config.replace(draft_vocab=size))
    return siblings[size]


def _provider_fn(engine, hf, name, gamma, policy, threshold, temperature, seed, tree=None, stop_at_eos=False):
    if name in HF_PROVIDERS:
        eos = sorted(engine.eos_ids) if stop_at_eos else None
        return lambda ids, n: (hf.generate(ids, n, name, eos), None)

    def ours(ids, n):
        r = engine.generate(ids, max_new_tokens=n, method=name, gamma=gamma, temperature=temperature, seed=seed,
                            policy=(policy or "fixed") if name == "sd" and tree is None else policy,
                            threshold=threshold, tree=tree,
                            ignore_eos=not stop_at_eos)
        return r.token_ids, r.stats
    return ours


def format_table(report: dict) -> str:
    cols = ["provider", "tokens_per_s", "speedup", "tokens_per_target_forward", "acceptance_rate",
            "mean_accepted_tokens", "gamma_mean", "draft_cost_ratio", "prediction_error", "exact_match_rate"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in report["results"]:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    env = report["environment"]
    head = [f"machine: {env['cpu']} ({env['cpu_isa']}), {env['cpu_threads']} threads" if env.get("device") == "cpu"
            else f"device: {env.get('device')}",
            f"dtype: {report['dtype']}, {invariant_summary(report.get('batch_invariant'))}; "
            f"exact_match_rate: share of prompts with exactly {report.get('exact_match_reference')}'s tokens"]
    bound = report.get("target_matvec_bound")
    if bound:
        head.append(f"target matvec bound: {bound['tokens_per_s_bound']:.2f} tokens/s "
                    f"({bound['weight_bytes'] / 1e9:.2f} GB of weights at {bound['matvec_gb_per_s']:.1f} GB/s measured)")
        ar = next((r for r in report["results"] if "decode_fraction_of_matvec_bound" in r), None)
        if ar:
            head.append(f"ar decoding (prefill excluded): {ar['decode_tokens_per_s']:.2f} tokens/s = "
                        f"{100 * ar['decode_fraction_of_matvec_bound']:.0f}% of the bound")
    return "\n".join(head + [""] + lines)


def invariant_summary(info: dict | None) -> str:
    if not info or not info["on"]:
        cost = info and info.get("cost")
        return "batch-invariant mode off" + (f" (it would cost {100 * cost:.1f}% per decode)" if cost else "")
    how = f"padded to {info['pad_width']}" if info["pad_width"] else "unpadded: kernels probed row-count invariant"
    cost = f", {100 * info['cost']:+.1f}% per decode" if info.get("cost") is not None else ""
    return f"batch-invariant mode on ({how}{cost})"


def save(report: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
