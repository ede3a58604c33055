"""Prompts for choosing the hybrid's constants (bench/hybrid_policy_replay.py --tuning), kept apart
from the prompts the benchmark reports on (bench/ngram_prompts.py, HumanEval): four that write
new code, where a draft model helps and little is copied, and four edits of given code. Written
for this purpose, from no test set."""
from ngram_prompts import _user

QUEUE = '''class BoundedQueue:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = []

    def push(self, item):
        if len(self.items) >= self.capacity:
            self.items.pop(0)
        self.items.append(item)

    def pop(self):
        if not self.items:
            return None
        return self.items.pop(0)

    def peek(self):
        return self.items[0] if self.items else None
'''

STATS = '''def mean(values):
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
'''

TUNING_PROMPTS = [
    _user("Write a Python function that merges overlapping intervals given as a list of (start, end) pairs."),
    _user("Write a Python class for an LRU cache with get and put methods, using only the standard library."),
    _user("Write a Python function that parses a duration string such as '1h30m15s' into seconds."),
    _user("Write a Python function that returns the k most frequent words in a text, ignoring case."),
    _user("Rename the class to RingBuffer and every 'items' to 'slots' in this code. Change nothing "
          "else.\n\n```python\n" + QUEUE + "```"),
    _user("Add type hints to every function in this module and keep the code otherwise exactly as it "
          "is.\n\n```python\n" + STATS + "```"),
    _user("This module divides by zero on an empty list. Return the whole file with each function "
          "raising ValueError on empty input.\n\n```python\n" + STATS + "```"),
    _user("Add a docstring to every method of this class and change nothing else.\n\n```python\n" + QUEUE + "```"),
]
