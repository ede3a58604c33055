"""Model-free drafting: continuations found in the row's own text (prompt lookup, n-grams).

`NgramIndex` holds one row's history (prompt + committed tokens) and, for every n in
[ngram_min, ngram_max], where each n-gram of it ended; appending tokens updates it in
O(new tokens x sizes). Proposals are a deterministic function of the history, so verifying
them as one-hot drafts is lossless (greedy: `ar`'s tokens; sampling: the target's
distribution), for chains and for trees (methods/token_tree.py's acceptance).

- `propose(gamma)`: the longest suffix of the history (n from ngram_max down to ngram_min)
  that also occurs earlier, and the up to γ tokens that followed its most recent earlier
  occurrence (fewer where the history ends first). transformers' prompt lookup
  (`prompt_lookup_num_tokens` = γ, `max_matching_ngram_size` = ngram_max) searches the same
  suffixes and takes the earliest occurrence; the most recent is what an edit copies next.
- `lookup()`: among the earlier occurrences of that suffix (the most recent MAX_OCCURRENCES),
  the one whose preceding tokens agree with the history's end the longest (the most recent on a
  tie), and that match length (capped at MATCH_CAP): what `gamma="auto"` proposes from, and how
  far it trusts it (ngram_policy.py).
- `propose_tree(topk, depth, budget)`: the continuations of every earlier occurrence (the
  most recent MAX_OCCURRENCES) merged into a trie, nodes ranked by how many occurrences pass
  through them, then by recency; the kept nodes are closed under ancestors.
"""
from __future__ import annotations

from ..errors import SpecEngineError

MAX_OCCURRENCES = 64  # a tree merges (a lookup scores) at most this many recent occurrences: bounded host time
MATCH_CAP = 32  # a lookup's match length is counted up to this many tokens


def check_sizes(ngram_max, ngram_min) -> None:
    for name, v in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecEngineError(f"{name} must be an integer >= 1, got {v!r}", name)
    if ngram_min > ngram_max:
        raise SpecEngineError(f"ngram_min ({ngram_min}) must not exceed ngram_max ({ngram_max})", "ngram_min")


class NgramIndex:
    def __init__(self, tokens: list[int], ngram_max: int = 3, ngram_min: int = 1):
        check_sizes(ngram_max, ngram_min)
        self.tokens: list[int] = []
        self.ends = {n: {} for n in range(ngram_max, ngram_min - 1, -1)}  # n -> {n-gram: [continuation starts]}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(int(t))
            L = len(toks)
            for n, table in self.ends.items():
                if L >= n:
                    table.setdefault(tuple(toks[L - n:]), []).append(L)

    def occurrences(self) -> tuple[int, list[int]]:
        """(n, where the continuations of the longest suffix's earlier occurrences start, oldest
        first); (0, []) when no suffix of ngram_min or more tokens occurs earlier."""
        L = len(self.tokens)
        for n, table in self.ends.items():
            if L >= n:
                starts = table.get(tuple(self.tokens[L - n:]), ())
                if len(starts) > 1:  # the last one is the suffix itself (its continuation starts at L)
                    return n, starts[:-1]
        return 0, []

    def propose(self, gamma: int) -> list[int]:
        _, starts = self.occurrences()
        return self.tokens[starts[-1]: starts[-1] + gamma] if starts else []

    def continuation(self, start: int, gamma: int) -> list[int]:
        """Up to γ tokens of the row's text from `start` (a lookup's continuation start)."""
        return self.tokens[start: start + gamma]

    def lookup(self) -> tuple[int, int] | None:
        """(continuation start, match length) of the best earlier occurrence; None without one."""
        best = None
        for s, m in self._scored():  # most recent first: it wins ties
            if best is None or m > best[1]:
                best = (s, m)
        return best

    def _scored(self):
        """(continuation start, match length) of the recent occurrences of the longest suffix,
        most recent first."""
        _, starts = self.occurrences()
        toks, last = self.tokens, len(self.tokens) - 1
        for s in reversed(starts[-MAX_OCCURRENCES:]):
            m = 0
            while m < MATCH_CAP and s - 1 - m >= 0 and toks[s - 1 - m] == toks[last - m]:
                m += 1
            yield s, m

    def continuations(self, handle, depth: int, m: int) -> list[tuple[int, list[int]]]:
        """(recency, up to `depth` tokens) after each recent occurrence that agrees with the end of
        the history over at least m tokens (a lookup's match length): what a tree is built from."""
        return [(s, self.tokens[s: s + depth]) for s, k in self._scored() if k >= m]

    def propose_tree(self, topk: int, depth: int, budget: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of up to `budget` draft nodes in depth-major order, parents as
        indices with 0 = the root (the last committed token) and nodes numbered from 1; at most
        `topk` children per node, `depth` levels. Empty when nothing matches."""
        _, starts = self.occurrences()
        return tree_of([(s, self.tokens[s: s + depth]) for s in starts[-MAX_OCCURRENCES:]], topk, budget)


def trie_of(continuations: list[tuple[int, list[int]]]) -> list[list[int]]:
    """Continuations (recency, tokens) merged into a trie: nodes 1..N as [token, parent, depth,
    how many continuations pass through it, the most recent of them], 0 = the root."""
    trie = {}  # (parent id, token) -> node id
    nodes = []
    for recency, toks in continuations:
        parent = 0
        for d, tok in enumerate(toks):
            node = trie.get((parent, tok))
            if node is None:
                node = trie[(parent, tok)] = len(nodes) + 1
                nodes.append([tok, parent, d + 1, 0, recency])
            nodes[node - 1][3] += 1
            nodes[node - 1][4] = recency
            parent = node
    return nodes


def tree_of(continuations: list[tuple[int, list[int]]], topk: int, budget: int) -> tuple[list[int], list[int]]:
    """Continuations (recency, tokens) merged into a trie, nodes ranked by how many continuations
    pass through them, then shallower, then most recent; the `budget` best kept, at most `topk`
    children a node, closed under ancestors; (tokens, parents) depth-major, 0 = the root."""
    nodes = trie_of(continuations)
    # most occurrences first, then shallower (a child never outnumbers its parent), then most recent
    order = sorted(range(1, len(nodes) + 1), key=lambda i: (-nodes[i - 1][3], nodes[i - 1][2], -nodes[i - 1][4]))
    kept, children = {0}, {}
    picked = []
    for i in order:
        if len(picked) == budget:
            break
        p = nodes[i - 1][1]
        if p in kept and children.get(p, 0) < topk:
            kept.add(i)
            children[p] = children.get(p, 0) + 1
            picked.append(i)
    return layout(nodes, picked)


def layout(nodes: list[list[int]], picked: list[int]) -> tuple[list[int], list[int]]:
    """The picked trie nodes (closed under ancestors, in rank order) as (tokens, parents),
    depth-major, parents renumbered (0 = the root, the nodes from 1)."""
    rank = {i: j for j, i in enumerate(picked)}
    picked = sorted(picked, key=lambda i: (nodes[i - 1][2], rank[i]))  # depth-major: parents first
    new_id = {0: 0, **{old: j + 1 for j, old in enumerate(picked)}}
    return [nodes[i - 1][0] for i in picked], [new_id[nodes[i - 1][1]] for i in picked]
