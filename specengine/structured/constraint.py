"""A request's output constraint: what the user asked for (JSON schema, regex, grammar, a choice,
OpenAI's `response_format`), checked and compiled by xgrammar for the engine's tokenizer.

xgrammar, not llguidance or outlines-core: it is the library vLLM and SGLang default to, ships
CPU wheels, compiles a schema in milliseconds and fills a token mask in ~10-90 us on our
Qwen2.5 tokenizer (docs/design.md, "Structured output"); its matcher also rolls back, which
speculation needs (a rejected draft is undone).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import SpecEngineError

KINDS = ("json_schema", "regex", "grammar", "choice", "json_object")


@dataclass(frozen=True)
class Constraint:
    """One row's constraint: `kind` (KINDS) and its source (a schema / regex / EBNF text; for a
    choice, the JSON list of strings; for json_object, "")."""
    kind: str
    source: str

    @staticmethod
    def parse(json_schema=None, regex=None, grammar=None, choice=None, response_format=None) -> "Constraint | None":
        """At most one of the options (None: no constraint); a SpecEngineError naming a bad one."""
        given = {k: v for k, v in dict(json_schema=json_schema, regex=regex, grammar=grammar, choice=choice,
                                       response_format=response_format).items() if v is not None}
        if len(given) > 1:
            raise SpecEngineError(f"give one output constraint, not {' and '.join(given)}", sorted(given)[1])
        if not given:
            return None
        (name, value), = given.items()
        if name == "response_format":
            return _response_format(value)
        if name == "json_schema":
            return Constraint("json_schema", _schema_text(value, "json_schema"))
        if name == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise SpecEngineError("choice must be a non-empty list of non-empty strings", "choice")
            return Constraint("choice", json.dumps(list(value)))
        if not isinstance(value, str) or not value:
            raise SpecEngineError(f"{name} must be a non-empty string", name)
        if name == "regex":
            try:
                re.compile(value)
            except re.error as e:
                raise SpecEngineError(f"regex does not compile: {e}", "regex") from None
        return Constraint(name, value)


def _schema_text(value, param: str) -> str:
    """A JSON schema given as a dict or as JSON text -> its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpecEngineError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise SpecEngineError(f"{param} must be a JSON schema object, got {type(value).__name__}", param)
    return json.dumps(value)


def _response_format(fmt) -> Constraint | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}} (a pydantic model of it is accepted as its dict)."""
    if hasattr(fmt, "model_dump"):
        fmt = fmt.model_dump(by_alias=True, exclude_none=True)
    if isinstance(fmt, str):  # the CLI's JSON text
        try:
            fmt = json.loads(fmt)
        except json.JSONDecodeError as e:
            raise SpecEngineError(f"response_format is not valid JSON: {e}", "response_format") from None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise SpecEngineError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                              "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint("json_object", "")
    inner = fmt.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise SpecEngineError("response_format of type json_schema needs json_schema: {'name': ..., 'schema': {...}}",
                              "response_format")
    return Constraint("json_schema", _schema_text(inner["schema"], "response_format"))


class Compiler:
    """xgrammar's compiler for one tokenizer and vocabulary size (the target's logits width), its
    compiled grammars cached; stop ids end a grammar (EOS is allowed only where it may end)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise SpecEngineError("structured output needs xgrammar: pip install 'specengine[structured]'") from e
        self.xgr, self.vocab_size, self.tokenizer = xgr, vocab_size, tokenizer
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled = {}

    def encode(self, text: str) -> list[int]:
        """A forced text's tokens as the tokenizer writes it (grammar drafting's proposals)."""
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def compile(self, c: Constraint):
        key = (c.kind, c.source)
        if key not in self._compiled:
            self._compiled[key] = self._compile(c)
        return self._compiled[key]

    def _compile(self, c: Constraint):
        comp, param = self.compiler, "response_format" if c.kind == "json_object" else c.kind
        try:
            if c.kind == "json_schema":  # json.dumps' whitespace only: no runaway blank lines, more forced tokens
                return comp.compile_json_schema(c.source, any_whitespace=False)
            if c.kind == "json_object":  # any JSON object, json.dumps' whitespace
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "regex":
                return comp.compile_regex(c.source)
            if c.kind == "choice":  # one of the strings, exactly: a regex of escaped alternatives
                return comp.compile_regex("|".join(f"({re.escape(s)})" for s in json.loads(c.source)))
            return comp.compile_grammar(c.source)
        except RuntimeError as e:  # xgrammar's message says what and where ("Unsupported type ...")
            message = str(e).strip().splitlines()[-1]
            message = re.sub(r"^\[[\d:]+\] \S+: ", "", message)
            raise SpecEngineError(f"{param} cannot be compiled: {message}", param) from None
