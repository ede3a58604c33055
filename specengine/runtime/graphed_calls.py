"""Pure device functions between a round's forwards, replayed from CUDA graphs.

A round's own work outside the model (tree acceptance, tree masks, the parallel drafter's
layout) is many small tensor ops: run eagerly on a GPU, each is a kernel launch between the
forwards' graph replays (tree acceptance alone is ~600 per round, mostly the counter-based
random numbers). `GraphedCalls` captures such a function once per key and argument shapes,
copies the arguments into static buffers, replays, and hands back copies of the static
outputs (the next replay overwrites them).

The function must be capture-safe: tensors in, a tensor or a tuple of tensors out, no host
sync, and every Python value it reads (ints, flags, a module) an argument that is not a
tensor: those are part of the key (hashable), and frozen at capture. The function itself is
part of the key too, so pass a module-level function (a bound method or a lambda made per
call would capture anew every time). Off CUDA (and with graphs off) the runner calls the
function directly: the same results.
"""
from __future__ import annotations

import torch

from .graphs import capture_graph


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


class GraphedCalls:
    def __init__(self, capture, device: torch.device):
        self.capture, self.device = capture, device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.entries: dict[tuple, tuple] = {}
        self.replays = 0

    def __call__(self, name: str, fn, *args):
        """fn(*args) from a graph replay (captured on the first call with this name and these
        argument shapes; non-tensor arguments are part of the key)."""
        key = (name, fn, _signature(args))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(fn, args)
        inputs, outputs, graph, single = entry
        for static, a in zip(inputs, args):
            if isinstance(a, torch.Tensor):
                static.copy_(a)
        graph.replay()
        self.replays += 1
        out = tuple(o.clone() for o in outputs)
        return out[0] if single else out

    def _capture(self, fn, args):
        # every tensor the graph reads or writes lives in this entry: a graph holds raw pointers
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        first = fn(*inputs)
        single = isinstance(first, torch.Tensor)
        outputs = tuple(o.clone() for o in ((first,) if single else first))

        def call():
            result = fn(*inputs)
            for static, o in zip(outputs, (result,) if single else result):
                static.copy_(o)
        return inputs, outputs, capture_graph(self.capture, call, self.pool, self.device), single
