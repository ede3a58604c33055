"""Where a Triton launch can be counted: the class whose `run` launches a kernel in this
process, the interpreter's under TRITON_INTERPRET=1 (CPU tensors), the JIT's otherwise."""
import os


def launch_class():
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction
