"""Arctic Inference's SuffixDecodingCache as a peer drafter inside our engine (bench/suffix.py).

Built in the benchmark's setup step, never on the tests' path: the registry serves
`arctic-inference` 0.3.0 as a source package only; its suffix tree (csrc/suffix_decoding, CMake +
nanobind, CPU) is compiled on its own into build/arctic, and only its `suffix_decoding` package is
imported from the unpacked source (the rest needs vLLM).

`ArcticIndex` gives one row's drafting the interface `NgramDecoding` plans with (NgramIndex's),
so Arctic's proposals are verified by the same target, tree verification and policies as ours:
`install()` registers the method `arctic-suffix` (`suffix` with Arctic's cache in place of ours).

    python bench/peers/arctic.py build     # once: ~1 minute on 2 cores
"""
from __future__ import annotations

import itertools
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "arctic"
VERSION = "0.3.0"


def source() -> Path:
    found = sorted(BUILD.glob("arctic_inference-*/csrc/suffix_decoding"))
    if found:
        return found[-1].parents[1]
    BUILD.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
                    f"arctic-inference=={VERSION}", "-d", str(BUILD)], check=True)
    with tarfile.open(next(BUILD.glob("arctic_inference-*.tar.gz"))) as tar:
        tar.extractall(BUILD, filter="data")
    return sorted(BUILD.glob("arctic_inference-*/csrc/suffix_decoding"))[-1].parents[1]


def build() -> Path:
    """The unpacked source with its compiled suffix tree (`_C`) in arctic_inference/suffix_decoding."""
    src = source()
    pkg = src / "arctic_inference" / "suffix_decoding"
    if list(pkg.glob("_C*.so")):
        return src
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "nanobind"], check=True)
    out = BUILD / "cmake"
    subprocess.run(["cmake", "-S", str(src / "csrc" / "suffix_decoding"), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j2"], check=True)
    for so in out.glob("_C*.so"):
        (pkg / so.name).write_bytes(so.read_bytes())
    return src


def cache(max_depth: int = 64, max_cached_requests: int = 10_000):
    src = build()
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    return SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)


_ids = itertools.count()


class ArcticIndex:
    """One row's proposals from Arctic's cache (its prompt tree and its global response tree), in
    NgramIndex's interface. Arctic's own speculation knobs at its defaults (max_spec_factor 1,
    min_token_prob 0.1); the length cap is the method's (its γ auto or fixed γ, its tree shape)."""

    def __init__(self, arctic, prompt: list[int], gamma_max: int):
        self.arctic, self.gamma_max, self.tokens = arctic, gamma_max, list(prompt)
        self.req = next(_ids)
        arctic.start_request(self.req, self.tokens)

    def stop(self) -> None:
        if self.req in self.arctic.active_requests:
            self.arctic.stop_request(self.req)

    def extend(self, new: list[int]) -> None:
        self.tokens.extend(int(t) for t in new)
        self.arctic.add_active_response(self.req, [int(t) for t in new])

    def _draft(self, budget: int, tree: bool):
        return self.arctic.speculate(self.req, self.tokens, max_spec_tokens=budget, use_tree_spec=tree)

    def lookup(self):
        d = self._draft(self.gamma_max, False)
        return (tuple(d.token_ids), d.match_len) if d.token_ids else None

    def continuation(self, handle, gamma: int) -> list[int]:
        return list(handle[:gamma])

    def propose(self, gamma: int) -> list[int]:
        return list(self._draft(gamma, False).token_ids)

    def propose_tree(self, topk: int, depth: int, budget: int) -> tuple[list[int], list[int]]:
        """Arctic's tree cut to our shape (at most topk children a node, depth levels, budget nodes,
        closed under ancestors), depth-major, parents renumbered (0 = the root)."""
        d = self._draft(budget, True)
        kept, children, level, order = {-1: 0}, {}, {-1: 0}, []
        for i, p in enumerate(d.parents):
            if p in kept and children.get(p, 0) < topk and level[p] < depth and len(order) < budget:
                children[p] = children.get(p, 0) + 1
                level[i] = level[p] + 1
                kept[i] = 0
                order.append(i)
        order.sort(key=lambda i: level[i])
        new_id = {-1: 0, **{old: j + 1 for j, old in enumerate(order)}}
        return [d.token_ids[i] for i in order], [new_id[d.parents[i]] for i in order]


def install(arctic) -> str:
    """Register the method `arctic-suffix`: `suffix` with rows drafting from Arctic's cache."""
    from specengine.methods import METHODS
    from specengine.methods.ngram import NgramDecoding

    class ArcticSuffix(NgramDecoding):
        name = "arctic-suffix"

        def _start_row(self, b, prompt, max_new):
            super()._start_row(b, prompt, max_new)
            old = getattr(self, "_arctic", {}).get(b)
            if old is not None:
                old.stop()
            self._arctic = getattr(self, "_arctic", {})
            self.index[b] = self._arctic[b] = ArcticIndex(arctic, prompt, self.max_width - 1)

        def stats(self, generation):
            for idx in getattr(self, "_arctic", {}).values():  # the call ends: its responses stay cached
                idx.stop()
            return super().stats(generation)

    METHODS[ArcticSuffix.name] = ArcticSuffix
    return ArcticSuffix.name


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
