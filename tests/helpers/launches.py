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
