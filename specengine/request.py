"""`RequestParams`: every per-request option written once, with its default, help and checks.

`Engine.generate` / `stream` take these as keyword arguments (or a RequestParams), the CLI
derives its generate flags from the fields (cli.py), the serving core queues them, and the
HTTP server builds its request schema from the fields marked `served` (serve/server.py,
under OpenAI's names). Engine options, by contrast, are `EngineConfig` (config.py).
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from .config import option, parse_gamma
from .errors import SpecEngineError
from .methods.sampling import FP32_MAX, SamplingParams

METHOD_OPTIONS = ("method", "gamma", "policy", "threshold", "tree")  # None: the engine's own


def _served(name: str, kind=None, **schema):
    """metadata of a field the server accepts: its name in the API, its JSON type where the
    default does not say it (kind), and its JSON-schema bounds."""
    return {"served": name, "schema": schema, **({"kind": kind} if kind is not None else {})}


def _choices(text: str) -> list[str]:
    """The CLI's --choice 'a|b|c'."""
    return text.split("|")


@dataclass(frozen=True)
class RequestParams:
    max_new_tokens: int = option(128, "new tokens per prompt, at most", **_served("max_tokens", ge=1))
    temperature: float = option(0.0, "0 = greedy (the target's own tokens); > 0 samples the target's distribution",
                                type=float, **_served("temperature", ge=0, le=FP32_MAX,
                                                      allow_inf_nan=False))
    top_k: int = option(0, "sample among the k most likely tokens (0 = off)", **_served("top_k", ge=0))
    top_p: float = option(1.0, "sample within the smallest set of this probability (1 = off)", type=float,
                          **_served("top_p", gt=0, le=1, allow_inf_nan=False))
    seed: int = option(0, "sampling seed (row b of a batch uses seed + b)", **_served("seed", ge=0, lt=2**63))
    stop: list[str] | str | None = option(None, "stop string(s): the text ends before the first one",
                                          **_served("stop"))
    ignore_eos: bool = option(False, "keep generating past EOS (benchmarks)", **_served("ignore_eos"))
    # the method for this call; None: the engine's (EngineConfig), and the server's for every row
    method: str | None = option(None, "ar | sd | pearl | parallelspec | ngram | hybrid for this call (default: the engine's)")
    gamma: int | str | None = option(None, "this call's draft length, or auto (default: the engine's)",
                                     type=parse_gamma)
    policy: str | None = option(None, "this call's sd draft-length policy (default: the engine's)")
    threshold: float | None = option(None, "this call's confidence / specdec++ threshold", type=float)
    tree: object = option(None, "sd / parallelspec / ngram: draft a token tree 'KxD[:N]' (top-K per depth, D levels, "
                          "N nodes kept), e.g. 4x5:16")
    # log-probabilities under the target, from the logits the rounds already have (methods/logprobs.py)
    logprobs: int | bool | None = option(None, "each generated token's log-probability and the top N alternatives "
                                         "(0: the token's only)", type=int)
    prompt_logprobs: bool = option(False, "each prompt token's log-probability (from the prefill)")
    # an output constraint (at most one; structured/constraint.py): the output is constrained ar's
    json_schema: object = option(None, "the output is JSON valid under this schema (a dict or JSON text)",
                                 **_served("guided_json", kind=dict | str))
    regex: str | None = option(None, "the output matches this regular expression", **_served("guided_regex", kind=str))
    grammar: str | None = option(None, "the output is in this grammar (GBNF / EBNF, xgrammar's dialect)",
                                 **_served("guided_grammar", kind=str))
    choice: list[str] | None = option(None, "the output is exactly one of these strings (CLI: 'a|b|c')",
                                      type=_choices, **_served("guided_choice", kind=list[str]))
    response_format: object = option(None, "OpenAI's: {'type': 'json_object'} or {'type': 'json_schema', "
                                     "'json_schema': {'name': ..., 'schema': {...}}} ({'type': 'text'}: none)")
    grammar_draft: bool = option(True, "under a constraint, tokens the grammar forces are drafted (sd chains, ngram, "
                                 "hybrid)", **_served("grammar_draft"))
    suffix_cache: bool = option(True, "suffix decoding: draft from earlier responses and remember this one (false: "
                                "neither)", **_served("suffix_cache"))
    logprobs_mode: str = option("raw", "raw: the target's log_softmax; processed: after top-k / top-p / temperature "
                                "(the distribution sampled from)")

    def validate(self) -> tuple[SamplingParams, list[str]]:
        """(the sampling parameters, the stop strings); SpecEngineError naming a bad field."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed), \
            check_limits(self.max_new_tokens, self.stop)

    def replace(self, **options) -> "RequestParams":
        """These params with `options` changed; an unknown name is refused, naming it."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise SpecEngineError(f"unknown request option {unknown[0]!r}; choose from {', '.join(names)}",
                                  unknown[0])
        return dataclasses.replace(self, **options) if options else self

    def constraint(self):
        """The call's output constraint (structured.Constraint), or None."""
        from .structured.constraint import Constraint

        return Constraint.parse(self.json_schema, self.regex, self.grammar, self.choice, self.response_format)

    def method_options(self) -> dict:
        """method, gamma, policy, threshold, tree (None: the engine's)."""
        return {name: getattr(self, name) for name in METHOD_OPTIONS}


def served_fields() -> list[dataclasses.Field]:
    """The fields a server request may carry (metadata: `served` name, `schema` bounds)."""
    return [f for f in dataclasses.fields(RequestParams) if "served" in f.metadata]


def check_limits(max_new_tokens, stop) -> list[str]:
    """Validate a call's (or a request's) max_new_tokens and stop strings; the stop list."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise SpecEngineError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}", "max_new_tokens")
    if stop is None or isinstance(stop, str):
        stops = [stop] if stop is not None else []
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
    else:
        raise SpecEngineError(f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
    if any(not isinstance(s, str) or not s for s in stops):
        raise SpecEngineError("stop strings must be non-empty strings", "stop")
    return stops
