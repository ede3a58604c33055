"""Token ids ranked by how often they occur in text, for a draft's cut LM head (models/subset_head.py).

A table is a safetensors file (`ids`, int32, most frequent first) whose metadata says how it
was counted and, as `tokens_sha256`, which token strings its ids stand for: a tokenizer fits
a table when its ids name the same strings (Qwen2.5, Qwen2.5-Coder and every tokenizer that
keeps their ids do). The shipped tables sit in `specengine/drafting/vocabs/`.

Ranking by id is no substitute: the first 32k ids of the Qwen tokenizer cover only 93% of this
repository's code tokens. Code alone is no substitute either: over the Python standard
library only, the top 32k covered 89% of the copy prompts' English (specengine/prompts.py, COPY_PROMPTS),
less than id order's 93%. The shipped table was counted over the standard library's sources
(code, docstrings, comments), the PEPs (python/peps at ba4deeb, English prose) and The Rust
Programming Language (rust-lang/book at 9175448, prose with code), none of them a benchmark
or test set:

    git -C peps archive ba4deeb peps | tar -x -C corpus/peps
    git -C book archive 9175448 src | tar -x -C corpus/book
    python -m specengine.drafting.frequent_vocab --tokenizer qwen2.5-coder-0.5b-instruct \\
        --out specengine/drafting/vocabs/qwen2.5.safetensors --corpus corpus/peps corpus/book \\
        --corpus-label "PEPs (python/peps@ba4deeb) and The Rust Book (rust-lang/book@9175448)"
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpecEngineError
from .artifacts import read_metadata, save_artifact

SHIPPED = Path(__file__).parent / "vocabs"
KEEP = 65536  # ids a table ranks: more than a cut head keeps
AUTO = 65536  # draft_vocab "auto": the shipped table covers 98.6% of the copy prompts' tokens and 99.3% of
# HumanEval's there (32768: 90.9% / 97.3%), a property of text, not of a machine


@dataclass
class VocabMeta:
    tokens_sha256: str  # of the ranked ids' token strings, one per line
    max_id: int  # a first, cheap filter: a tokenizer without that id cannot fit (no hashing needed)
    ids: int
    corpus: str
    corpus_tokens: int
    command: str


def tokens_sha256(tokenizer, ids: list[int]) -> str:
    names = tokenizer.convert_ids_to_tokens(ids)
    return hashlib.sha256("\n".join(str(n) for n in names).encode()).hexdigest()


def read_table(path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["ids"].to(torch.int64)


def fitting_table(tokenizer) -> tuple[Path, torch.Tensor] | None:
    """(path, ranked ids) of the shipped table whose ids name this tokenizer's tokens, if any
    (none for a stand-in that cannot name tokens)."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    for path in sorted(SHIPPED.glob("*.safetensors")):
        meta = read_metadata(path, "frequency table")
        if _too_small(tokenizer, meta):
            continue
        ids = read_table(path)
        if meta.get("tokens_sha256") == tokens_sha256(tokenizer, ids.tolist()):
            return path, ids
    return None


def _too_small(tokenizer, meta: dict) -> bool:
    try:
        return "max_id" in meta and len(tokenizer) <= int(meta["max_id"])
    except TypeError:  # a tokenizer without a length: hash it
        return False


def draft_head_ids(setting, tokenizer, vocab_size: int) -> torch.Tensor | None:
    """The ids a draft head keeps for the engine option draft_vocab (None: the full head).
    "auto": AUTO ids where a shipped table fits and that halves the head or more; 0: none cut.
    The tokenizer's special tokens are kept beside the ranked ids (`frequent_ids`)."""
    if setting == 0 or (setting == "auto" and vocab_size < 2 * AUTO):
        return None
    if setting == "auto":
        found = fitting_table(tokenizer)
        return None if found is None else _kept(*found, AUTO, vocab_size, tokenizer)
    return frequent_ids(tokenizer, setting, vocab_size)


def frequent_ids(tokenizer, size: int, vocab_size: int, table=None) -> torch.Tensor:
    """The `size` most frequent ids from `table` (a file) or the shipped table that fits `tokenizer`,
    and the tokenizer's special tokens (`_kept`), sorted by id; every id below `vocab_size`."""
    if table is None:
        found = fitting_table(tokenizer)
        if found is None:
            raise SpecEngineError("draft_vocab: no frequency table ships for this tokenizer; count one with "
                                  "`python -m specengine.drafting.frequent_vocab --tokenizer <model> --out <file>`",
                                  "draft_vocab")
        path, ids = found
    else:
        path, ids = Path(table), read_table(table)
        if read_metadata(path, "frequency table").get("tokens_sha256") != tokens_sha256(tokenizer, ids.tolist()):
            raise SpecEngineError(f"the frequency table {path} was counted with another tokenizer "
                                  "(its ids name other tokens)", "draft_vocab")
    return _kept(path, ids, size, vocab_size, tokenizer)


def _kept(path: Path, ids: torch.Tensor, size: int, vocab_size: int, tokenizer) -> torch.Tensor:
    """The table's first `size` ids and the tokenizer's special tokens below `vocab_size` (end of text, a
    chat turn's start and end, tool calls; 22 for Qwen2.5), sorted. A corpus of files never holds the
    special tokens, so no table ranks them, yet a reply ends on one: without them the draft could never
    propose a turn's end (MT-bench, 40 prompts x 96 tokens of `ar` on the default pair: 87 of the 137
    target tokens outside the 65,536 ranked ids were <|im_start|>, <|im_end|> and <|endoftext|>)."""
    if not 1 <= size <= len(ids):
        raise SpecEngineError(f"draft_vocab must be between 1 and {len(ids)} (the ids {path.name} ranks), "
                              f"got {size}", "draft_vocab")
    kept = ids[:size]
    if int(kept.max()) >= vocab_size:
        raise SpecEngineError(f"the frequency table {path.name} ranks ids past the draft's vocabulary "
                              f"({vocab_size})", "draft_vocab")
    added = getattr(tokenizer, "added_tokens_decoder", {})  # control tokens: <|im_start|>, <tool_call>, FIM's
    special = [*getattr(tokenizer, "all_special_ids", []), *(i for i, t in added.items() if getattr(t, "special", False))]
    special = sorted({i for i in special if isinstance(i, int) and 0 <= i < vocab_size})
    return torch.cat([kept, torch.tensor(special, dtype=torch.int64)]).unique()  # unique() sorts


def count(tokenizer, files: list[Path], progress: bool = True) -> tuple[collections.Counter, int]:
    from tqdm import tqdm

    counts, total = collections.Counter(), 0
    for f in tqdm(files, desc="counting tokens", disable=not progress):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        counts.update(ids)
        total += len(ids)
    return counts, total


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                  and "tests" not in p.parts)


def build_table(tokenizer, files: list[Path], out, corpus: str, command: str, progress: bool = True) -> Path:
    """Count `files` with `tokenizer` and write the table of its KEEP most frequent ids (ids the
    corpus never used follow in id order) to `out`."""
    counts, total = count(tokenizer, files, progress)
    ranked = [i for i, _ in counts.most_common()]
    seen = set(ranked)
    ranked += [i for i in range(len(tokenizer)) if i not in seen]
    ids = ranked[:KEEP]
    meta = VocabMeta(tokens_sha256(tokenizer, ids), max(ids), len(ids), corpus, total, command)
    path = save_artifact(out, {"ids": torch.tensor(ids, dtype=torch.int32)}, meta)
    top = sum(counts[i] for i in ids[:32768]) / max(total, 1)
    print(f"wrote {path}: {len(ids)} ids ranked over {total} tokens; the top 32768 cover {top:.1%} of them")
    return path


def corpus_files(paths: list[str]) -> list[Path]:
    """Text files under each folder (.py .md .rst .txt), or the files named."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in (".py", ".md", ".rst", ".txt") and f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise SpecEngineError(f"corpus path not found: {p}")
    return out


def main(argv=None) -> int:
    from ..models.loading import load_tokenizer, resolve

    ap = argparse.ArgumentParser(description="count a token-frequency table for draft_vocab")
    ap.add_argument("--tokenizer", required=True, help="a model name, directory or .gguf whose tokenizer counts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", nargs="*", default=[], metavar="PATH",
                    help="more text to count besides the standard library (folders of .py/.md/.rst/.txt, or files)")
    ap.add_argument("--corpus-label", default="", help="what the --corpus paths are, for the table's metadata")
    args = ap.parse_args(argv)
    std, extra = stdlib_sources(), corpus_files(args.corpus)
    label = f"Python {sys.version.split()[0]} standard library sources without tests ({len(std)} files)"
    if extra:
        label += f" + {args.corpus_label or 'more text'} ({len(extra)} files)"
    build_table(load_tokenizer(resolve(args.tokenizer)), std + extra, args.out, label,
                "python -m specengine.drafting.frequent_vocab " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
