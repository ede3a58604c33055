"""Structured output: constraints (JSON schema, regex, grammar, choice) compiled by xgrammar, and
the per-row matchers that mask a round's target logits (docs/design.md, "Structured output")."""
from .constraint import KINDS, Compiler, Constraint
from .rows import RowConstraints

__all__ = ["KINDS", "Compiler", "Constraint", "RowConstraints"]
