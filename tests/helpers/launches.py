"""Counting device launches: aten ops that launch no kernel on a GPU, and the class whose
`run` launches a Triton kernel in this process (the interpreter's under TRITON_INTERPRET=1,
the JIT's otherwise)."""
import os

# aten ops that only make a view or a new empty tensor: no kernel on a GPU
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "transpose", "permute",
             "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
             "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "_to_copy_noop", "size", "stride", "dim", "is_contiguous", "sym_size",
             "sym_stride", "sym_numel", "numel", "promote_types", "result_type"}


def launch_class():
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction


class Rehearsal:
    """Each Triton op of an ops table runs its kernel once per call signature (shapes, dtypes,
    strides, scalar arguments), where the counter records every launch the call makes (its
    kernels and its launcher's aten ops); a later call with the same signature reports those
    launches and computes its result with the op's torch reference, unseen by the counter. The
    interpreter then runs each kernel shape once per test module instead of once per call
    (test_round_launches.py checks both ways count alike)."""

    def __init__(self):
        self.seen: dict = {}
        self.counter = None  # the test's counter: .launch(name), .depth (> 0: not counted)
        self._recording: list | None = None
        self._depth = 0

    def note(self, name: str, depth: int) -> None:
        """The counter saw a launch: part of the call being rehearsed when at its depth."""
        if self._recording is not None and depth == self._depth:
            self._recording.append(name)

    def table(self, ops):
        import dataclasses

        from specengine.kernels.ops import OPS

        wrapped = {op: self._wrap(op, getattr(ops, op), getattr(OPS[op][0], OPS[op][1]))
                   for op in OPS if ops.kernel(op)}
        return dataclasses.replace(ops, **wrapped)

    def _wrap(self, op, kernel, reference):
        def call(*args, **kwargs):
            key = (op, _signature(args), _signature(sorted(kwargs.items())))
            counter = self.counter
            if key not in self.seen or counter is None:
                outer = self._recording, self._depth
                self._recording, self._depth = [], counter.depth if counter else 0
                try:
                    return kernel(*args, **kwargs)
                finally:
                    if counter is not None:
                        self.seen[key] = self._recording
                    self._recording, self._depth = outer
            for name in self.seen[key]:
                counter.launch(name)
            counter.depth += 1
            try:
                return reference(*args, **kwargs)
            finally:
                counter.depth -= 1
        return call


def _signature(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride(), value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__
