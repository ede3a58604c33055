"""A draft may speculate for a target only if its token ids mean the same text: the same
token -> id map over the ids the draft can emit, and the same ids for the special tokens the
engine acts on (EOS, the chat markers). Sizes alone prove nothing: two tokenizers of one size
can number their tokens differently, and every draft would then be misread or rejected.
A target whose vocabulary is padded past the draft's (Qwen2.5-7B+: 152,064 rows for 151,936
tokens) passes: only the draft's range is compared."""
from __future__ import annotations

import filecmp
from pathlib import Path

from ..errors import SpecEngineError

# What transformers builds a tokenizer from: two folders alike in every one of these hold one tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Whether folders a and b hold byte-identical tokenizer files (then the draft's need not be
    loaded and compared: ~1.3 s of a load of the default pair on the 2-vCPU EPYC VM)."""
    if a == b:
        return True
    present = [n for n in TOKENIZER_FILES if (a / n).exists() or (b / n).exists()]
    if not any(n in present for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return False
    return all((a / n).exists() and (b / n).exists() and filecmp.cmp(a / n, b / n, shallow=False) for n in present)


def _by_id(tok, upto: int) -> dict[int, str]:
    return {i: t for t, i in tok.get_vocab().items() if i < upto}


def check_tokenizers(target_tok, draft_tok, draft_vocab: int) -> None:
    """Raise a SpecEngineError naming the first id whose token differs (over the draft's
    `draft_vocab` ids), or the first special token whose id differs."""
    target, draft = _by_id(target_tok, draft_vocab), _by_id(draft_tok, draft_vocab)
    for i in range(draft_vocab):
        a, b = target.get(i), draft.get(i)
        if a != b:
            raise SpecEngineError(
                f"the draft's tokenizer differs from the target's at id {i}: the target reads {a!r}, the draft "
                f"{b!r}; a draft must share the target's tokenizer", "draft")
    specials = {"eos_token": (target_tok.eos_token_id, draft_tok.eos_token_id)}
    for t in dict.fromkeys(list(target_tok.all_special_tokens) + list(draft_tok.all_special_tokens)):
        specials[t] = (target_tok.convert_tokens_to_ids(t), draft_tok.convert_tokens_to_ids(t))
    for name, (a, b) in specials.items():
        if a != b:
            raise SpecEngineError(
                f"the draft's tokenizer gives special token {name!r} id {b!r}, the target's {a!r}; a draft "
                "must share the target's tokenizer", "draft")
