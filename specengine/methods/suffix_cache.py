"""Suffix decoding's memory across requests (Arctic Inference's SuffixDecoding, arXiv 2411.04975,
learned from, not copied): what earlier responses wrote, searched for the current text's suffix.

`SuffixCache` keeps recent responses (each whole, oldest evicted first, at most `max_tokens`
tokens in all) concatenated with a separator, and for every n in `sizes` where each n-gram of
them ended, as `NgramIndex` does for one row (methods/ngram_index.py). A lookup takes the
longest suffix of a row's text (n from the largest size down) that an earlier response holds,
and proposes what followed it: a chain from the most recent occurrence, or a tree of the
continuations of its recent occurrences ranked by how many pass through each node (the
frequency Arctic's tree is built from). Host work per committed token is O(len(sizes)) dict
updates, and a lookup O(len(sizes)) dict reads plus the proposal it returns: no walk of a tree
node by node per token.

Memory is bounded: `max_tokens` tokens and `len(sizes)` index entries per token held, plus the
evicted responses' stale ones until a rebuild drops them (once they are half the tokens kept):
at most about twice that (`entries`). A lookup reads only the live tail of an n-gram's list.
Proposals are deterministic functions of the cache and the row's text, verified as one-hot
drafts: lossless as every n-gram proposal is.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque

from ..errors import SpecEngineError
from .ngram_index import MATCH_CAP, MAX_OCCURRENCES, tree_of

SEP = -1  # between responses: no match runs across two of them


class SuffixCache:
    def __init__(self, max_tokens: int = 100_000, sizes: tuple[int, ...] = (8, 4, 2)):
        self.max_tokens, self.sizes = max_tokens, tuple(sorted(set(sizes), reverse=True))
        self.tokens: list[int] = []  # tokens[i] is absolute position base + i
        self.base = 0
        self.spans: deque = deque()  # (absolute start, end) of each response held, oldest first
        self.ends = {n: {} for n in self.sizes}  # n -> {n-gram: [absolute continuation starts]}
        self.entries = 0  # index entries held (stale ones included until a rebuild)
        self.size = 0  # tokens of the responses held

    def __len__(self) -> int:
        return self.size

    def add(self, response: list[int]) -> None:
        """Remember one finished response (the oldest ones go when the cache is full)."""
        response = [int(t) for t in response][-self.max_tokens:]
        if len(response) < 2:
            return
        start = self.base + len(self.tokens)
        self.tokens.extend(response)
        self.tokens.append(SEP)
        self.spans.append((start, start + len(response)))
        self.size += len(response)
        self._index(start, start + len(response))
        while self.size > self.max_tokens:
            s, e = self.spans.popleft()
            self.size -= e - s
        if self.spans and self.spans[0][0] > self.base and 2 * (self.spans[0][0] - self.base) > len(self.tokens):
            self._rebuild()

    def _index(self, start: int, end: int) -> None:
        toks, base = self.tokens, self.base
        for n, table in self.ends.items():
            for j in range(start + n, end + 1):  # the n-gram ending before j; its continuation starts at j
                table.setdefault(tuple(toks[j - n - base: j - base]), []).append(j)
                self.entries += 1

    def _rebuild(self) -> None:
        """Drop evicted responses' tokens and index entries (amortized: at most once per half)."""
        first = self.spans[0][0]
        self.tokens = self.tokens[first - self.base:]
        self.base = first
        self.ends, self.entries = {n: {} for n in self.sizes}, 0
        for s, e in self.spans:
            self._index(s, e)

    def occurrences(self, text: list[int]) -> tuple[int, list[int]]:
        """(n, the absolute starts of the continuations of the longest suffix of `text` that a held
        response contains: its most recent MAX_OCCURRENCES, oldest first); (0, []) when none does.
        Each list is in increasing order, so the evicted ones are a prefix, found by bisection."""
        live = self.spans[0][0] if self.spans else self.base + len(self.tokens)
        for n, table in self.ends.items():
            if len(text) >= n:
                starts = table.get(tuple(text[-n:]), ())
                first = max(bisect_left(starts, live), len(starts) - MAX_OCCURRENCES)
                if first < len(starts):
                    return n, starts[first:]
        return 0, []

    def continuation(self, start: int, gamma: int) -> list[int]:
        """Up to γ tokens from absolute `start`, ending at its response's end."""
        out = self.tokens[start - self.base: start - self.base + gamma]
        return out[: out.index(SEP)] if SEP in out else out

    def lookup(self, text: list[int]) -> tuple[int, int] | None:
        """(continuation start, match length) of the held occurrence whose preceding tokens agree
        with the end of `text` the longest (up to MATCH_CAP; the most recent on a tie), as
        NgramIndex.lookup does in a row: how far γ auto trusts it. None without one."""
        best = None
        for s, m in self._scored(text):  # most recent first: it wins ties
            if best is None or m > best[1]:
                best = (s, m)
        return best

    def _scored(self, text: list[int]):
        """(absolute continuation start, match length) of the occurrences, most recent first."""
        n, starts = self.occurrences(text)
        toks, base, last = self.tokens, self.base, len(text) - 1
        for s in reversed(starts):
            m, i = n, s - base - 1 - n  # the n-gram agrees; walk on before it (a SEP or `base` stops it)
            while m < MATCH_CAP and i >= 0 and last - m >= 0 and toks[i] == text[last - m]:
                m, i = m + 1, i - 1
            yield s, m

    def continuations(self, text: list[int], depth: int, m: int) -> list[tuple[int, list[int]]]:
        """(recency, up to `depth` tokens) after each held occurrence agreeing with `text` over >= m."""
        return [(s, self.continuation(s, depth)) for s, k in self._scored(text) if k >= m]

    def propose(self, text: list[int], gamma: int) -> tuple[int, list[int]]:
        """(match length, up to γ tokens that followed the most recent occurrence)."""
        n, starts = self.occurrences(text)
        return (n, self.continuation(starts[-1], gamma)) if starts else (0, [])

    def propose_tree(self, text: list[int], topk: int, depth: int, budget: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of up to `budget` nodes, as NgramIndex.propose_tree: continuations of the
        recent occurrences merged into a trie, most-travelled nodes first, closed under ancestors."""
        _, starts = self.occurrences(text)
        return tree_of([(s, self.continuation(s, depth)) for s in starts], topk, budget)


class SuffixIndex:
    """One row's drafting source for `suffix`: its own text (NgramIndex) and the engine's
    SuffixCache of earlier responses; each lookup takes whichever matches the longer suffix (the
    row's own on a tie). Same interface as NgramIndex, so NgramDecoding plans with either."""

    def __init__(self, row, cache: SuffixCache):
        self.row, self.cache = row, cache

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    def extend(self, new: list[int]) -> None:
        self.row.extend(new)

    def lookup(self):
        """((source, start), match length) or None: the row's best occurrence or the cache's."""
        own, held = self.row.lookup(), self.cache.lookup(self.row.tokens)
        if held is not None and (own is None or held[1] > own[1]):
            return ("cache", held[0]), held[1]
        return None if own is None else (("row", own[0]), own[1])

    def continuation(self, handle, gamma: int) -> list[int]:
        source, start = handle
        return (self.cache if source == "cache" else self.row).continuation(start, gamma)

    def continuations(self, handle, depth: int, m: int) -> list[tuple[int, list[int]]]:
        if handle[0] == "cache":
            return self.cache.continuations(self.row.tokens, depth, m)
        return self.row.continuations(handle, depth, m)

    def propose(self, gamma: int) -> list[int]:
        hit = self.lookup()
        return [] if hit is None else self.continuation(hit[0], gamma)

    def propose_tree(self, topk: int, depth: int, budget: int) -> tuple[list[int], list[int]]:
        own_n, _ = self.row.occurrences()
        n, _ = self.cache.occurrences(self.row.tokens)
        if n > own_n:
            return self.cache.propose_tree(self.row.tokens, topk, depth, budget)
        return self.row.propose_tree(topk, depth, budget)


class SuffixCaches:
    """One SuffixCache per key (the server's API key; "" for the Python API), so that one user's
    text is never proposed to another's requests; each bounded by `max_tokens`, at most
    `max_keys` keys (the least recently used dropped)."""

    def __init__(self, max_tokens: int = 100_000, max_keys: int = 64):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise SpecEngineError(f"suffix_cache_tokens must be an integer >= 0 (0: remember nothing), got "
                                  f"{max_tokens!r}", "suffix_cache_tokens")
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self.caches: dict[str, SuffixCache] = {}

    def get(self, key: str) -> SuffixCache:
        cache = self.caches.pop(key, None)  # not `or`: an empty cache is falsy, and rows hold this object
        if cache is None:
            cache = SuffixCache(max(self.max_tokens, 1))
        self.caches[key] = cache  # most recently used last
        while len(self.caches) > self.max_keys:
            self.caches.pop(next(iter(self.caches)))
        return cache

    def remember(self, key: str | None, response: list[int]) -> None:
        """A finished response under `key` (None: the request opted out)."""
        if key is not None and self.max_tokens > 0:
            self.get(key).add(response)
