"""Public API: `Engine.from_pretrained(...)`, `generate(...)`, `stream(...)`."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import EngineConfig
from .eos import eos_ids
from .errors import SpecEngineError
from .generation import Generation, headroom
from .methods import METHODS, Method
from .methods.context import MethodContext
from .methods.logprobs import LogprobSpec, TokenLogprob
from . import huge_pages, precision
from .models.cpu_matmul import optimize, unpack
from .models.loading import load_tokenizer, resolve
from .models.quant_plan import choose_layouts, hold
from .models.tokenizer_check import check_tokenizers, same_tokenizer_files
from .models.subset_head import set_head_vocab
from .models.vocab import pad_vocab
from .drafting.frequent_vocab import draft_head_ids
from .pair import load_pair
from .runtime.cross_device import CrossDeviceDraft
from .runtime.graphs import dedicated_stream
from .runtime.kernel_choice import choose_kernels
from .runtime.runner import ModelRunner
from .encoding import check_capacity, encode
from .request import RequestParams
from .structured.constraint import Compiler
from .methods.steps import prepare_chains
from .methods.suffix_cache import SuffixCaches
from .runtime.step_costs import FiledClocks, recalled_or_measured


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length" | "stop"
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per token_ids entry (generate(logprobs=k))
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first


class Engine:
    """A target model, an optional draft model sharing its tokenizer, and a decoding method."""

    def __init__(self, target, tokenizer, draft=None, config: EngineConfig | None = None, **options):
        """target / draft: our `Transformer` modules (see `from_pretrained` to load them).
        A draft on another device than the target runs there (PEARL on two GPUs).
        Options: an `EngineConfig` and/or its fields as keywords (config.py documents each).
        batch_invariant "auto" (default) turns the mode on for a bf16/fp16 target when it
        costs at most 5% per decode here (measured at start-up): speculation then gives
        exactly ar's tokens in 16-bit precision too (docs/design.md)."""
        cfg = self.config = (config or EngineConfig()).replace(**options)
        if draft is target:
            raise SpecEngineError("draft and target must be separate model objects (each owns its KV cache)")
        if draft is not None:  # a draft over a prefix of a padded target vocabulary is padded to it, in place
            pad_vocab(draft, target.config.vocab_size)
            set_head_vocab(draft, draft_head_ids(cfg.draft_vocab, tokenizer, draft.config.vocab_size))  # FR-Spec
        elif cfg.draft_vocab not in ("auto", 0):
            raise SpecEngineError("draft_vocab cuts a draft model's LM head; there is no draft model", "draft_vocab")
        huge_pages.enable(cfg.huge_pages)  # whether set_cpu_matmul (below) holds the CPU weights in 2 MiB pages
        self.tokenizer, self.max_seq_len = tokenizer, cfg.max_seq_len
        self.target = ModelRunner(target, cfg.kernels, cfg.cuda_graphs, cfg.max_batch)
        self.device, self.draft = self.target.device, None
        self._draft_head = None if draft is None else draft.lm_head  # this engine's (draft_vocab), see _start
        if draft is not None:
            runner = ModelRunner(draft, cfg.kernels, cfg.cuda_graphs, cfg.max_batch)
            self.draft = runner if runner.device == self.device else CrossDeviceDraft(runner, self.device)
        self.method = cfg.method or ("sd" if draft is not None else "ar")
        self._check_method(self.method)
        self._heads, self._drafter = {}, None  # mode -> AcceptanceHead; the parallel drafter: loaded on first use
        self._step_costs = {}  # batch -> StepCosts, measured on first need (sd gamma="auto", pearl)
        self.suffix_caches = SuffixCaches(cfg.suffix_cache_tokens)  # suffix decoding's memory, per key
        self._acceptance = {}  # decoding mode -> the draft's acceptance over the recent calls (γ auto)
        self._side_stream, self.kernel_choice = None, {}  # kernel_choice: warmup()'s timed gemv, per role
        self._replay = None  # a benchmark's acceptance replay (specengine/replay); never set otherwise
        # `ar` launches each round before reading the last ("Overlapped rounds"): only a GPU runs ahead of the host
        self.overlap_rounds = self.device.type == "cuda"
        self.dtype_choice, self._dtype_notes = None, set()  # from_pretrained sets the choice (dtype "auto")
        self._plan_cpu_matmul(cfg.cpu_matmul)
        self.set_batch_invariant(cfg.batch_invariant, cfg.invariant_width)  # probes the kernels the plan chose
        self.eos_ids = eos_ids(self.tokenizer, self.target.config.hf_config)

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, config: EngineConfig | None = None,
                        **options) -> "Engine":
        """Load target (and draft) from a registry name, HF directory, hub-cache id or .gguf;
        draft="ngram": no draft model, n-gram drafting from the row's own text (method "ngram");
        draft="suffix": the same and from the engine's earlier responses (method "suffix").

        dtype="auto": bfloat16 on CUDA; on a CPU, each model's dtype (float32 or bfloat16) for
        its role: the pair that maximizes the engine's method's expected tokens/s, from the
        matmul costs measured on this machine (once, cached; precision.py). `dtype_choice`
        says what was chosen and the costs behind it. A draft may differ from its target:
        the sampler works in fp32, and greedy output is the target's own either way.
        draft_device: put the draft on its own device (e.g. "cuda:1"), so PEARL's draft and
        target forwards run on two GPUs; default: the target's device. Every other option
        is the Engine's (EngineConfig).
        """
        cfg = (config or EngineConfig()).replace(**options)
        if draft in ("ngram", "suffix"):  # model-free drafting: no draft model, the method proposes from text
            draft, cfg = None, cfg.replace(method=cfg.method or draft)
        tmodel, tpath, dmodel, choice = load_pair(target, draft, cfg)
        tokenizer = load_tokenizer(tpath)
        if dmodel is not None and not same_tokenizer_files(tpath, dpath := resolve(draft)):  # ids must mean the target's
            check_tokenizers(tokenizer, load_tokenizer(dpath), dmodel.config.vocab_size)
        engine = cls(tmodel, tokenizer, dmodel, cfg)
        engine.dtype_choice = choice
        return engine

    def acceptance_head(self, mode: str = "greedy"):
        """The SpecDec++ head for this draft: the one given to the engine, else the one shipped
        for this draft and decoding mode (or, failing that, the other mode's)."""
        from .drafting.acceptance_head import AcceptanceHead, default_head_path, load_head

        if mode not in self._heads:
            config = self.draft.model.config
            src = self.config.acceptance_head
            if src is None:
                other = "sampled" if mode == "greedy" else "greedy"
                src = default_head_path(config, mode) or default_head_path(config, other)
                if src is None:
                    raise SpecEngineError(
                        "policy 'specdec++' needs an acceptance head for this draft and none ships for it; "
                        "train one with `specengine train-head` and pass acceptance_head=<file>")
            head = src if isinstance(src, AcceptanceHead) else load_head(src)
            head.check_fits(config)
            self._heads[mode] = head.to(self.device).eval()  # hidden states arrive on the target's device
        return self._heads[mode]

    def parallel_drafter(self):
        """ParallelSpec's drafter for this draft: the one given to the engine, else the one
        shipped for this draft (specengine/drafting/drafters/, matched by fingerprint)."""
        from .drafting.parallel_drafter import ParallelDrafter, load_drafter, shipped_drafter

        if self._drafter is None:
            if isinstance(self.draft, CrossDeviceDraft):
                raise SpecEngineError("parallelspec needs the draft on the target's device")
            src, model = self.config.parallel_drafter, self.draft.model
            if isinstance(src, ParallelDrafter):
                src.check_fits(model.config)
                self._drafter = src.to(model.device, model.dtype)  # as load_drafter gives
            else:
                if src is None:
                    src = shipped_drafter(model.config)
                    if src is None:
                        raise SpecEngineError(
                            "method 'parallelspec' needs a parallel drafter for this draft and none ships for it; "
                            "train one with `specengine train-parallel` and pass parallel_drafter=<file>")
                self._drafter = load_drafter(src, model)
        return self._drafter

    def set_cpu_matmul(self, mode: str = "auto") -> None:
        """"auto": CPU Linear layers take the fastest matmul path per shape and row count, GGUF blocks the faster layout
        (measured once per machine); "linear": F.linear, GGUF blocks in the file's rows. Batch invariance is decided again."""
        self._plan_cpu_matmul(mode)
        self._step_costs = {}  # timed on the old paths
        if self.device.type == "cpu":  # its probe's verdict was on the kernels the old plan took
            self.set_batch_invariant(self.config.batch_invariant, self.config.invariant_width)

    def _plan_cpu_matmul(self, mode: str) -> None:
        self.config = self.config.replace(cpu_matmul=mode)  # checked there; the config stays true
        for runner in (r for r in self._runners() if r.device.type == "cpu"):
            if mode == "auto":  # GGUF blocks also take the layout their kernel reads faster here
                choose_layouts(runner.model)
                optimize(runner.model)
            else:
                unpack(runner.model)
            hold(runner.model)  # float weights as the plans left them, into 2 MiB pages (huge_pages.py)

    def step_costs(self, state, max_width: int, draft: bool = True):
        """Measured draft step and target forward costs (widths 1..max_width) per batch size, cached (on a CPU also in
        the machine's table). draft=False: the target's only (draft_s 0), for a method that leaves the draft out."""
        key = state.batch if draft and self.draft is not None else (state.batch, "target")
        have, wide = self._step_costs.get(key), self._step_costs.get(state.batch)
        if have is None and key != state.batch and wide is not None and len(wide.target_s) >= max_width:
            have = self._step_costs[key] = wide.target_only()  # the target's, timed with the draft's
        if have is None or len(have.target_s) < max_width:
            have = self._step_costs[key] = recalled_or_measured(self.target, self.draft if draft else None, state,
                                                                max_width)
        return have

    @property
    def plan(self):
        """Every choice this engine made by measuring the machine (planner.py): precision per
        role, ops, matmul paths and GGUF layouts, batch-invariant mode, step costs. print() it."""
        from .planner import plan_of
        return plan_of(self)

    @property
    def measured_step_costs(self) -> dict:
        """{batch (or (batch, "target")): StepCosts} measured so far: what γ "auto" chose by."""
        return dict(self._step_costs)

    def warmup(self, batch: int = 1) -> dict:
        """Pay one-time costs now, not in the first call: a GPU's few-row linears per model (timed: `kernel_choice`),
        KV buffers, CUDA graphs of every bucket and draft chain (Triton autotunes there), the step costs of every cost-
        driven choice (sd / hybrid γ auto, n-gram, PEARL's window) at its widest, batch invariance. -> graph bytes per model."""
        prompt = [[0, 0]] * batch if batch > 1 else [0, 0]
        self.kernel_choice = choose_kernels(self._runners(), self.config.kernels)  # GPU only; {} elsewhere
        self._step_costs = {} if self.kernel_choice else self._step_costs  # a timed choice: costs taken after it
        methods = ("hybrid", "sd", "pearl", "ngram") if self.draft is not None else ("ngram",)  # hybrid's widths: the others'
        widest = max(self.new_method(m, gamma="auto").max_width for m in methods)
        self.target.invariance.ensure(batch, widest)
        with self._clocks.paused():  # each measures (once per engine and batch) what its first call would
            for method in methods:
                self.generate(prompt, method=method, max_new_tokens=2, ignore_eos=True, gamma="auto", suffix_cache=False)
        prepare_chains(self.method_context(), range(1, widest))  # every chain graph a greedy call may replay
        self._acceptance.clear()  # a junk prompt's acceptance (not filed): recalled, a first sd call ran 0.77x the next
        return {name: (r.graphs.memory_bytes if r.graphs is not None else 0)
                for name, r in zip(("target", "draft"), self._runners())}

    def set_batch_invariant(self, mode="auto", width: int = 9) -> None:
        """True | False | "auto": see `Engine.__init__`; `batch_invariant_info` says what the
        target runner's BatchInvariance found (runtime/invariance.py)."""
        self.config = self.config.replace(batch_invariant=mode, invariant_width=width)
        info = self.target.invariance.configure(mode, width)
        self.batch_invariant, self.batch_invariant_info, self._step_costs = info["on"], info, {}  # padding moves costs

    def set_kernels(self, kernels="auto") -> None:
        """The one switch between torch references and Triton kernels, for every op of both
        models and the samplers: "auto" | "torch" | "triton", with optional per-op overrides
        ("triton,attention=torch"; kernels/ops.py). `engine.ops.names` says what runs."""
        self.config, self.kernel_choice = self.config.replace(kernels=kernels), {}  # checked there; gemv: cuBLAS
        for runner in self._runners():
            runner.set_kernels(kernels)
        self._step_costs = {}  # timed on the other ops: γ auto would price kernels that no longer run

    @property
    def ops(self):
        """The target's ops table (kernels/ops.py): what every op of a forward runs, batch-
        invariant mode's attention included, and the samplers the methods use."""
        return self.target.ops

    def set_cuda_graphs(self, enabled: bool = True, capture=None, lazy: bool = False) -> None:
        """Replay CUDA graphs for decode/verify steps (CUDA only; eager elsewhere), captured
        when the next call allocates its buffers (lazy: each bucket when a step first needs
        it). `capture` stands in for torch.cuda.graph capture (tests use one on CPU)."""
        self.config = self.config.replace(cuda_graphs=bool(enabled))  # the config stays true
        for runner in self._runners():
            runner.set_cuda_graphs(enabled, capture, lazy)
        self._step_costs = {}  # a graphed step costs less host time than an eager one: timed again

    def _runners(self):
        """The ModelRunners (the draft's unwrapped when it lives on another device)."""
        yield self.target
        if self.draft is not None:
            yield getattr(self.draft, "runner", self.draft)

    def side_stream(self):
        """The second CUDA stream PEARL runs the draft on (None off CUDA): no capture stream."""
        if self.device.type == "cuda" and self._side_stream is None:
            self._side_stream = dedicated_stream(self.device)
        return self._side_stream

    def new_method(self, method=None, gamma=None, policy=None, threshold=None, tree=None) -> Method:
        """The method object for one generation (or the serving core's rows), options checked;
        the engine's gamma / policy / threshold are its defaults."""
        method = method or self.method
        self._check_method(method)
        return METHODS[method](gamma, policy, threshold, tree=tree, defaults=self.config)

    def method_context(self) -> MethodContext:
        """What a method may use during a generation: runners, samplers, and this engine's
        step-cost cache, head, drafter and side stream (resolved lazily, on first use)."""
        replay = self._replay  # set only by specengine.replay.Replay.attach (benchmarks)
        self._clocks.seed(self._acceptance)  # the rounds' cost corrections the last process filed
        return MethodContext(self.target, self.draft, self.device, self.ops, step_costs=self.step_costs,
                             acceptance_head=replay.acceptance_head if replay else self.acceptance_head,
                             parallel_drafter=self.parallel_drafter, side_stream=self.side_stream,
                             acceptance=self._acceptance, replay=replay, suffix_caches=self.suffix_caches)

    @functools.cached_property
    def _clocks(self) -> FiledClocks:
        """The rounds' measured cost corrections, filed in the machine's table (step_costs.py)."""
        return FiledClocks(self.target, self.draft)

    # ------------------------------------------------------------------ helpers
    def _say_better_dtypes(self, method: str) -> None:
        """Warn once per method when dtype "auto" chose for another method and this one is
        predicted faster with other dtypes (precision.better_setting)."""
        if method in self._dtype_notes:
            return
        self._dtype_notes.add(method)
        draft = self.draft.model if self.draft is not None else None
        note = precision.better_setting(self.dtype_choice, method, self.target.model, draft)
        if note:
            warnings.warn(note, RuntimeWarning, stacklevel=4)

    def _check_method(self, method):
        if method not in METHODS:
            raise SpecEngineError(f"unknown method {method!r}; choose from {', '.join(METHODS)}", "method")
        if METHODS[method].needs_draft and self.draft is None:
            raise SpecEngineError(f"method {method!r} needs a draft model (pass draft=...)", "method")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, prompt) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt and whether the input was a batch (encoding.py)."""
        return encode(self.tokenizer, self.target.config.vocab_size, prompt)

    # ------------------------------------------------------------------ generation
    def check_capacity(self, prompts: list[list[int]], max_new_tokens: int, method: Method) -> None:
        """The prompts, their new tokens and the method's speculation headroom fit the KV buffer."""
        check_capacity(prompts, max_new_tokens, self.max_seq_len, headroom(method, self.target))

    def set_draft_head(self, ids: torch.Tensor | None) -> None:
        """The draft's LM head over `ids` only (None: its full head): `draft_vocab` with ids of
        one's own (a benchmark on random weights has no tokenizer to match a table)."""
        if self.draft is None:
            raise SpecEngineError("set_draft_head needs a draft model", "draft_vocab")
        set_head_vocab(self.draft.model, ids)
        self._draft_head = self.draft.model.lm_head
        self.draft.drop_graphs()

    def _own_draft_head(self) -> None:
        """Engines built on one draft model may cut its head differently (draft_vocab): a call
        puts this engine's head back, and drops graphs the draft captured with another."""
        model = getattr(self.draft, "model", None)
        if model is not None and model.lm_head is not self._draft_head:
            model.lm_head = self._draft_head
            self.draft.drop_graphs()

    def _start(self, prompt, params: RequestParams | None = None, **options) -> tuple[Generation, bool]:
        request = (params or RequestParams()).replace(**options)
        spec = LogprobSpec.parse(request.logprobs, request.logprobs_mode)
        m = request.method_options()
        chosen = self.new_method(m["method"], m["gamma"], m["policy"], m["threshold"], m["tree"])
        self._say_better_dtypes(chosen.name)
        self._own_draft_head()
        sampling, stops = request.validate()
        prompts, batched = self.encode(prompt)
        self.check_capacity(prompts, request.max_new_tokens, chosen)
        eos = set() if request.ignore_eos else self.eos_ids
        constraint = request.constraint()
        if constraint is not None:
            self.grammar_compiler.compile(constraint)  # a schema it cannot compile: an error before any work
        return Generation(self, prompts, sampling, request.max_new_tokens, chosen, eos, stops, spec,
                          bool(request.prompt_logprobs), overlap=self.overlap_rounds,
                          constraints=None if constraint is None else [constraint] * len(prompts),
                          grammar_draft=request.grammar_draft, cache_key="" if request.suffix_cache else None), batched

    @functools.cached_property
    def grammar_compiler(self) -> Compiler:
        """xgrammar's compiler for this tokenizer and the target's logits (structured/constraint.py),
        made on the first constrained call; EOS is allowed where a grammar may end."""
        return Compiler(self.tokenizer, self.target.config.vocab_size, self.eos_ids)

    @torch.inference_mode()
    def generate(self, prompt, params: RequestParams | None = None, **options):
        """Generate for one prompt (-> GenerationResult) or a batch (-> list of them).

        Options (request.py `RequestParams`, as keywords or a params object): max_new_tokens
        (128), temperature (0 = greedy), top_k, top_p, seed, stop, ignore_eos, and this
        call's method, gamma, policy, threshold and tree (default: the engine's). tree: sd /
        parallelspec draft a token tree instead of a chain: "KxD:N" (top-K per depth, D
        levels, N nodes kept), a dict or a TreeShape (docs/design.md, "Token trees")."""
        gen, batched = self._start(prompt, params, **options)
        self.last_stats = None
        for _ in gen.rounds():
            pass
        stats = gen.stats()
        self._clocks.file(self._acceptance)  # re-planned where this call's rounds missed the filed plan
        results = []
        for row in gen.rows:
            text = self.decode(row.ids)
            if row.stop_text_end is not None:
                text = text[: row.stop_text_end]
            results.append(GenerationResult(text, row.ids, row.prompt_len, row.finish_reason, stats, row.logprobs,
                                            row.prompt_logprobs))
        return results if batched else results[0]

    def stream(self, prompt, params: RequestParams | None = None, **options) -> Iterator[str]:
        """Yield text as it is committed (one prompt). Same options as `generate`; the call's
        stats are in `engine.last_stats` afterwards."""
        with torch.inference_mode():
            gen, batched = self._start(prompt, params, **options)
        if batched:
            raise SpecEngineError("stream() takes one prompt; use generate() for a batch")
        gen.track_text = True  # incremental detokenization: O(new tokens) per round, not the whole text
        rounds, row, sent = gen.rounds(), gen.rows[0], ""
        while True:
            with torch.inference_mode():
                if next(rounds, None) is None:
                    break
            text = row.visible_text()
            if len(text) > len(sent):
                yield text[len(sent):]
                sent = text
        self.last_stats = gen.stats()
        self._clocks.file(self._acceptance)

