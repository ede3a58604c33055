"""Prefix-affinity routing for the engine replicas on Ray Serve (`RequestRouterConfig`): a request
goes to the replica that last served the longest start of its text, so a chat's next turn lands
where its prefix's K/V still is (prefix reuse) and where suffix decoding has seen its kind of
text. Ray's own PrefixCacheAffinityRouter needs Ray's LLM extras (pyarrow, vLLM's stack); this is
the same idea on `ray.serve.request_router`, Ray's documented extension point (learned from, not
copied):

- load first: when the preferred replica's queue is `imbalance` requests longer than the
  shortest, the request goes the default way (two random replicas, the shorter queue);
- a match must cover `min_match` of the request's text, else the default way;
- the index is a sorted list of recent texts: the text sharing the longest start with a request
  is next to it in sort order, so a lookup is two bisections and two comparisons.
"""
from __future__ import annotations

import bisect
import os
import random

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


def request_text(pending: PendingRequest | None) -> str | None:
    """The text a request's K/V starts with: a completion's prompt, or a chat's messages in order
    (so turn 2's text starts with turn 1's). None for anything else (a control call)."""
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    messages = getattr(req, "messages", None)
    if messages is not None:
        return "".join(f"<|{m.get('role', '')}|>{m.get('content') or ''}" for m in messages)
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids: their decimal spelling keeps prefixes prefixes
        return " ".join(map(str, prompt)) + " "
    return None


def _shared(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


class PrefixIndex:
    """Recent request texts and the replica each went to, oldest forgotten first."""

    def __init__(self, max_entries: int = 4096, max_chars: int = 4096):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._sorted: list[str] = []
        self._owner: dict[str, ReplicaID] = {}  # in insertion order: the oldest first

    def insert(self, text: str, replica: ReplicaID) -> None:
        text = text[:self.max_chars]
        if self._owner.pop(text, None) is None:
            bisect.insort(self._sorted, text)
        self._owner[text] = replica  # (again) the newest
        while len(self._owner) > self.max_entries:
            self._forget(next(iter(self._owner)))

    def best(self, text: str, among: set) -> tuple[ReplicaID | None, int]:
        """(replica, shared characters) of the entry sharing the longest start with text, among
        the given replicas."""
        text = text[:self.max_chars]
        i = bisect.bisect_left(self._sorted, text)
        best, length = None, 0
        for j in (i - 1, i):  # its neighbours in sort order hold the longest shared start
            while 0 <= j < len(self._sorted):
                owner = self._owner[self._sorted[j]]
                if owner in among:
                    n = _shared(text, self._sorted[j])
                    if n > length:
                        best, length = owner, n
                    break
                j += 1 if j >= i else -1  # an entry of a replica gone or busy: look one further
        return best, length

    def drop(self, replica: ReplicaID) -> None:
        for text in [t for t, r in self._owner.items() if r == replica]:
            self._forget(text)

    def _forget(self, text: str) -> None:
        if self._owner.pop(text, None) is not None:
            i = bisect.bisect_left(self._sorted, text)
            if i < len(self._sorted) and self._sorted[i] == text:
                self._sorted.pop(i)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance: int = 4, min_match: float = 0.1, max_entries: int = 4096):
        self.imbalance, self.min_match = imbalance, min_match
        self.index = PrefixIndex(max_entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        two = random.sample(candidate_replicas, k=min(2, len(candidate_replicas)))
        text = request_text(pending_request)
        if text:
            by_id = {r.replica_id: r for r in candidate_replicas}
            owner, shared = self.index.best(text, set(by_id))
            if owner is not None and shared >= self.min_match * min(len(text), self.index.max_chars):
                queue = self.replica_queue_len_cache
                lens = [queue.get(r) for r in by_id]
                known = [n for n in lens if n is not None]
                mine = queue.get(owner)
                if mine is None or not known or mine - min(known) <= self.imbalance:
                    # the owner first; the default pair if it refuses
                    return [[by_id[owner]], [r for r in two if r.replica_id != owner] or two]
        return [two]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        text = request_text(pending_request)
        if text:
            self.index.insert(text, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id)
