"""Command line: `specengine generate | serve | bench | fetch | train-head | train-parallel ...`.

Every user error prints one line (`error: ...`) and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .config import EngineConfig
from .errors import SpecEngineError
from .models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET, REGISTRY
from .request import METHOD_OPTIONS, RequestParams


def _engine_args(p: argparse.ArgumentParser, **defaults):
    """--target, --draft, and one flag per EngineConfig field (its help and checks live there);
    `defaults`: this command's own defaults for some of them."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, HF dir, hub-cache id or .gguf")
    p.add_argument("--draft", default=None, help="draft model (same forms as --target), or ngram: no draft model, "
                   "n-gram drafting from the prompt and output (method ngram)")
    for f in dataclasses.fields(EngineConfig):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        text = meta["help"].replace("%", "%%")
        if f.default is True:  # a switch that turns an on-by-default option off
            p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", default=None,
                           help=text)
        elif "choices" in meta:
            p.add_argument(flag, default=None, choices=list(meta["choices"]), help=text)
        else:
            default = defaults.get(f.name, f.default)
            shown = "" if default is None or "default" in text else f" (default: {default})"
            parse = meta.get("type") or (int if type(f.default) is int else str)
            p.add_argument(flag, default=defaults.get(f.name), type=_cli_type(parse), help=text + shown)


def _request_args(p: argparse.ArgumentParser, names=None, **helps):
    """One flag per RequestParams field (its default, help and parser live there), for the
    fields in `names` (default: those the engine flags do not already set); `helps`: this
    command's own help for some of them."""
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(RequestParams):
        if (names is not None and f.name not in names) or (names is None and f.name in engine):
            continue
        flag, text = "--" + f.name.replace("_", "-"), helps.get(f.name, f.metadata["help"]).replace("%", "%%")
        if f.default is False:
            p.add_argument(flag, action="store_true", help=text)
        elif f.default is True:
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", help=text)
        elif f.name == "stop":
            p.add_argument(flag, action="append", default=None, help=text + " (repeatable)")
        else:
            parse = f.metadata.get("type") or (int if type(f.default) is int else str)
            shown = "" if f.default is None else f" (default: {f.default})"
            p.add_argument(flag, default=f.default, type=_cli_type(parse), help=text + shown)


def request_from_args(args) -> RequestParams:
    """The RequestParams the command line asks for: its request flags, and the method flags it
    shares with the engine (--method, --gamma, ...) when given (PEARL reads its window per call)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RequestParams) if hasattr(args, f.name)}
    return RequestParams(**{k: v for k, v in given.items() if v is not None or k not in METHOD_OPTIONS})


def _cli_type(parse):
    """argparse's type: the config's parser, with our error turned into argparse's."""
    def convert(text):
        try:
            return parse(text)
        except (SpecEngineError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def config_from_args(args) -> EngineConfig:
    """The EngineConfig the command line asks for (flags not given keep the config's defaults)."""
    given = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = f.metadata["choices"][value] if "choices" in f.metadata else value
    return EngineConfig(**given)


def _training_parser(sub, name: str, what: str, recipe):
    """The options every train-* command shares; defaults from the recipe dataclass."""
    p = sub.add_parser(name, help=f"train {what} for a (target, draft) pair")
    _engine_args(p)
    p.add_argument("--out", required=True, help="file to write (.safetensors; a .json report beside it)")
    p.add_argument("--packages", default=",".join(recipe.packages),
                   help="installed packages whose Python sources form the corpus")
    p.add_argument("--n-train", type=int, default=recipe.n_train, help="training chunks")
    p.add_argument("--n-val", type=int, default=recipe.n_val, help="held-out chunks (from held-out files)")
    p.add_argument("--seq-len", type=int, default=recipe.seq_len)
    p.add_argument("--epochs", type=int, default=recipe.epochs)
    p.add_argument("--work-dir", default=None, help="cache + checkpoint (resumable; default <out>.work)")
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specengine", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a completion")
    _engine_args(g)
    g.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    _request_args(g)
    g.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    g.add_argument("--json", action="store_true", help="print the result and stats as JSON")

    b = sub.add_parser("bench", help="run providers side by side on HumanEval prompts")
    _engine_args(b)
    b.add_argument("--providers", default="ar,sd",
                   help="comma list of ar, sd, sd:<gamma>, sd:auto, sd[:<gamma>]@<policy>[=<threshold>], "
                        "sd[tree=KxD:N], pearl, pearl:<gamma>[@parallel], parallelspec[:k], "
                        "parallelspec[tree=KxD:N], hf, hf-assisted")
    b.add_argument("--n-prompts", type=int, default=8)
    b.add_argument("--baseline", default=None, help="provider the speedups are relative to (default: first)")
    _request_args(b, ("max_new_tokens", "temperature", "seed"), temperature="> 0: our providers sample (same seed)")
    b.add_argument("--stop-at-eos", action="store_true",
                   help="every provider stops at EOS (whole replies); default: exactly --max-new-tokens each")
    b.add_argument("--out", default=None, help="write the JSON report here")

    from .training.head import HeadRecipe
    from .training.parallel import ParallelRecipe

    t = _training_parser(sub, "train-head", "a SpecDec++ acceptance head", HeadRecipe())
    t.add_argument("--mode", default="greedy", help="greedy | sampled: the decoding mode the labels are made for")
    t.add_argument("--mix", type=float, default=0.15, help="fraction of target tokens in the mixed sequences")
    t.add_argument("--reject-weight", type=float, default=6.0, help="BCE weight of rejections")

    tp = _training_parser(sub, "train-parallel", "a ParallelSpec parallel drafter", ParallelRecipe())
    tp.add_argument("--k-max", type=int, default=4, help="tokens per draft forward the drafter can propose")
    tp.add_argument("--groups", type=int, default=16, help="mask groups per chunk")
    tp.add_argument("--rank", type=int, default=8, help="LoRA rank of the mask-row adapters")

    _serve_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)"))

    pl = sub.add_parser("plan", help="load an engine and print what it measured and chose on this machine")
    _engine_args(pl)
    pl.add_argument("--warmup", action="store_true", help="measure the step costs too (engine.warmup)")
    pl.add_argument("--json", action="store_true", help="the plan as JSON")

    f = sub.add_parser("fetch", help="download + convert a registry model into the cache")
    f.add_argument("names", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT], help=", ".join(REGISTRY))
    return ap


def _serve_args(s) -> None:
    """`specengine serve`: one engine in this process, or replicas on Ray Serve (--ray)."""
    _engine_args(s, max_batch=8)  # rows served at once (and the CUDA graphs' largest batch)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default=None, help="the name clients pass as `model` (default: --target)")
    s.add_argument("--max-waiting", type=int, default=64, help="waiting requests before answering 503")
    s.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=None,
                   help="a request continuing a conversation reuses its row's K/V (default: on where the target "
                        "computes in fp32)")
    s.add_argument("--default-max-tokens", type=int, default=256, help="when a request has no max_tokens")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $SPECENGINE_API_KEY, if set); "
                        "KEY1,KEY2,...: several tenants, whose suffix-decoding caches stay apart")
    r = s.add_argument_group("replicas on Ray Serve (pip install 'specengine[ray]'; docs/serving.md)")
    r.add_argument("--ray", action="store_true", help="serve N engine replicas behind Ray Serve's HTTP proxy")
    r.add_argument("--replicas", type=int, default=1, help="engine replicas (with --ray)")
    r.add_argument("--router", choices=("prefix", "pow2"), default="prefix",
                   help="prefix: a request goes to the replica that served its text's start; pow2: Ray's default")
    r.add_argument("--cpus-per-replica", type=float, default=1.0)
    r.add_argument("--gpus-per-replica", type=float, default=0.0)
    r.add_argument("--autoscale", default=None, metavar="MIN:MAX[:TARGET]",
                   help="autoscale between MIN and MAX replicas at TARGET ongoing requests each (default 2)")
    r.add_argument("--ray-address", default=None, help="a running cluster (default: $RAY_ADDRESS, else a local one)")


def _serve_ray(args):
    from .serve.ray_app import ReplicaSpec, run

    scale = None
    if args.autoscale:
        parts = args.autoscale.split(":")
        if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts):
            raise SpecEngineError(f"--autoscale wants MIN:MAX[:TARGET] (integers), got {args.autoscale!r}", "autoscale")
        scale = {"min_replicas": int(parts[0]), "max_replicas": int(parts[1]),
                 "target_ongoing_requests": int(parts[2]) if len(parts) == 3 else 2}
    core = dict(max_batch=args.max_batch, max_waiting=args.max_waiting, gamma=args.gamma, prefix_reuse=args.prefix_reuse)
    spec = ReplicaSpec(args.target, args.draft, config_from_args(args), core, replicas=args.replicas,
                       autoscaling=scale, cpus=args.cpus_per_replica, gpus=args.gpus_per_replica, router=args.router)
    key = args.api_key or os.environ.get("SPECENGINE_API_KEY") or None
    print(f"serving {args.target} on http://{args.host}:{args.port}/v1 with "
          f"{args.autoscale or args.replicas} Ray Serve replica(s), {args.router} routing", file=sys.stderr)
    run(spec, args.host, args.port, args.model_name or args.target, args.default_max_tokens, key, args.ray_address)


def _load(args):
    from .api import Engine

    return Engine.from_pretrained(args.target, draft=args.draft, config=config_from_args(args))


def cmd_generate(args):
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = _load(args)
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    params = request_from_args(args)  # method options: the engine's (its flags)
    if (params.logprobs is not None or params.prompt_logprobs) and not args.json:
        raise SpecEngineError("--logprobs / --prompt-logprobs are printed with --json", "logprobs")
    if args.json or args.no_stream:
        r = engine.generate(prompt, params)
        if args.json:
            lps = {k: [None if e is None else dataclasses.asdict(e) for e in v]
                   for k, v in (("logprobs", r.logprobs), ("prompt_logprobs", r.prompt_logprobs)) if v is not None}
            print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                              **lps, "stats": r.stats}, indent=2))
        else:
            print(r.text)
            print(_stats_line(r.stats), file=sys.stderr)
        return
    for piece in engine.stream(prompt, params):
        print(piece, end="", flush=True)
    print()
    print(_stats_line(engine.last_stats), file=sys.stderr)


def _stats_line(stats: dict) -> str:
    keys = ("method", "new_tokens", "tokens_per_s", "tokens_per_target_forward", "acceptance_rate", "gamma_mean",
            "mean_accepted_tokens")
    return "[" + ", ".join(f"{k}={stats[k]:.3g}" if isinstance(stats[k], float) else f"{k}={stats[k]}"
                           for k in keys if k in stats) + "]"


def cmd_bench(args):
    from .benchmark import format_table, run_benchmark, save
    from .models.loading import resolve

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    engine = _load(args)
    report = run_benchmark(engine, providers, args.n_prompts, args.max_new_tokens,
                           target_path=resolve(args.target),
                           draft_path=resolve(args.draft) if args.draft not in (None, "ngram") else None,
                           baseline=args.baseline,
                           temperature=args.temperature, seed=args.seed, stop_at_eos=args.stop_at_eos)
    print(format_table(report))
    if args.out:
        print(f"wrote {save(report, args.out)}")
    else:
        print(json.dumps(report, indent=2))


def _trainer(args, what: str):
    """(engine, corpus packages, the command line) for the train-* commands."""
    if args.draft is None:
        raise SpecEngineError(f"{what} needs --draft")
    args.policy, args.acceptance_head, args.parallel_drafter = "fixed", None, None  # forwards only
    args.draft_vocab = 0  # training reads the draft's full LM head
    packages = tuple(p.strip() for p in args.packages.split(",") if p.strip())
    return _load(args), packages, "specengine " + " ".join(sys.argv[1:])


def cmd_train_head(args):
    from .training.head import HeadRecipe, train_head

    engine, packages, command = _trainer(args, "train-head")
    recipe = HeadRecipe(packages=packages, n_train=args.n_train, n_val=args.n_val, seq_len=args.seq_len,
                        mix=args.mix, mode=args.mode, reject_weight=args.reject_weight, epochs=args.epochs)
    report = train_head(engine, args.out, recipe, args.work_dir, draft_name=args.draft, command=command)
    print(f"wrote {args.out}: {report.train_positions} train / {report.val_positions} held-out positions, "
          f"held-out AUROC {report.val_auroc:.3f} (constant predictor 0.5), extraction {report.extract_seconds:.0f} s, "
          f"training {report.train_seconds:.0f} s")


def cmd_train_parallel(args):
    from .training.parallel import ParallelRecipe, train_parallel

    engine, packages, command = _trainer(args, "train-parallel")
    recipe = ParallelRecipe(packages=packages, n_train=args.n_train, n_val=args.n_val, seq_len=args.seq_len,
                            k_max=args.k_max, groups=args.groups, rank=args.rank, epochs=args.epochs)
    report = train_parallel(engine, args.out, recipe, args.work_dir, draft_name=args.draft, command=command)
    before = "resumed" if report.val_loss_before is None else f"{report.val_loss_before:.3f}"
    print(f"wrote {args.out}: held-out loss {before} -> {report.val_loss_after:.3f}, "
          f"mask agreement with the target's argmax {report.val_mask_agreement_after}, "
          f"teacher {report.teacher_seconds:.0f} s, training {report.train_seconds:.0f} s")


def cmd_serve(args):
    if args.ray:
        return _serve_ray(args)
    from .serve.server import serve

    engine = _load(args)
    print("warming up (buffers, graphs, every cost-driven method's step costs) so no request pays it",
          file=sys.stderr)
    engine.warmup(batch=args.max_batch)
    key = args.api_key or os.environ.get("SPECENGINE_API_KEY") or None
    print(f"serving {args.target} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}; API key "
          f"{'required' if key else 'not required'})", file=sys.stderr)  # never the key itself
    serve(engine, args.model_name or args.target, host=args.host, port=args.port, max_batch=args.max_batch,
          max_waiting=args.max_waiting, default_max_tokens=args.default_max_tokens, gamma=args.gamma, api_key=key,
          prefix_reuse=args.prefix_reuse)


def cmd_plan(args):
    engine = _load(args)
    if args.warmup:
        engine.warmup()
    plan = engine.plan
    print(json.dumps(plan.as_dict(), indent=1) if args.json else plan)


def cmd_fetch(args):
    from .models.fetch import fetch

    for name in args.names:
        print(fetch(name))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "bench": cmd_bench, "fetch": cmd_fetch, "train-head": cmd_train_head,
         "train-parallel": cmd_train_parallel, "serve": cmd_serve, "plan": cmd_plan}[args.cmd](args)
    except SpecEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
