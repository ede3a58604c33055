"""The prefix-affinity router's index against a brute-force search (no cluster): the replica whose
recent text shares the longest start with a request, among the replicas still eligible."""
import os
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
from specengine.serve.ray_router import PrefixIndex, request_text  # noqa: E402


def brute(entries: dict, text: str, among: set):
    best, length = None, 0
    for t, r in entries.items():
        n = len(os.path.commonprefix([t, text]))
        if r in among and n > length:
            best, length = r, n
    return best, length


def test_best_match_equals_a_brute_force_search():
    rng = random.Random(3)
    words = ["def ", "class ", "x = ", "return ", "(a, b)", ":\n", "    ", "import os\n"]
    index, entries = PrefixIndex(max_entries=60), {}
    for step in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        among = set(rng.sample(range(4), rng.randint(1, 4)))
        got = index.best(text, among)
        want = brute(entries, text, among)
        assert got[1] == want[1], step  # the same shared length (owners may tie) ...
        assert got[1] == 0 or any(r == got[0] and len(os.path.commonprefix([t, text])) == got[1]
                                  for t, r in entries.items()), step  # ... held by the replica named
        replica = rng.randrange(4)
        index.insert(text, replica)
        entries.pop(text, None)
        entries[text] = replica
        while len(entries) > 60:  # the index forgets oldest first, so the reference does too
            entries.pop(next(iter(entries)))
        if step % 97 == 96:
            gone = rng.randrange(4)
            index.drop(gone)
            entries = {t: r for t, r in entries.items() if r != gone}


def test_a_chats_text_starts_with_its_earlier_turns():
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    t1, t2 = (request_text(SimpleNamespace(args=[SimpleNamespace(messages=m, prompt=None)])) for m in (turn1, turn2))
    assert t2.startswith(t1) and len(t2) > len(t1)
    ids = request_text(SimpleNamespace(args=[SimpleNamespace(messages=None, prompt=[1, 23, 4])]))
    assert request_text(SimpleNamespace(args=[SimpleNamespace(messages=None, prompt=[1, 23, 4, 5])])).startswith(ids)
    assert not request_text(SimpleNamespace(args=[SimpleNamespace(messages=None, prompt=[1, 2])])).startswith(ids)
    assert request_text(SimpleNamespace(args=[])) is None


def test_the_serve_run_builder_checks_its_arguments():
    """`serve run specengine.serve.ray_app:app target=... replicas=2`: an application, options
    read as Ray's; a missing target or an unknown argument is an error naming them."""
    from specengine import SpecEngineError
    from specengine.serve.ray_app import app

    built = app({"target": "t", "replicas": "2", "router": "pow2", "max_batch": "4"})
    assert type(built).__name__ == "Application"
    with pytest.raises(SpecEngineError, match="unknown: \\['replica'\\]"):
        app({"target": "t", "replica": "2"})
    with pytest.raises(SpecEngineError, match="target="):
        app({"replicas": "2"})
    with pytest.raises(SpecEngineError, match="router must be one of"):
        app({"target": "t", "router": "random"})
