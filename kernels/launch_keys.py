"""Which Triton specializations a piece of code launches: `record_launches()` collects one key per distinct
(kernel, specialization) seen while it is active. Used by the warm-up tests and scripts/gpu_check.py.

Why: Triton compiles a kernel once per specialization key, and on a GPU a compile takes 1-3 s. A key that first
appears while serving (a step whose metadata tensor sits at another 16-byte alignment, a runtime int whose
divisibility by 16 changed) stalls that step and every request in it. So the server's warm-up must launch every
key a step can, and the tests check that a run of steps sees no key its warm-up did not.

The key mirrors what Triton 3.x specializes on (`create_function_from_signature` / `specialize_impl` in
triton/runtime/jit.py):
- a tensor argument: its dtype and whether data_ptr() % 16 == 0 (unless listed in do_not_specialize_on_alignment);
- an int argument: its type (i32 / u32 / i64 / u64 by value), and, unless listed in do_not_specialize, whether it
  is 1 (then it is a constant) or a multiple of 16;
- floats: their type only; bools, None: their value; constexpr arguments: their value;
- the launch options num_warps and num_stages (None = Triton's default).
It is read from the arguments of `run`, the launch entry point `kernel[grid](...)` calls on both JITFunction
(compiled) and InterpretedFunction (TRITON_INTERPRET=1), so it works on CUDA and on CPU alike.
"""
from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

Key = tuple[str, tuple]  # (kernel name, specialization)

_LOCK = threading.Lock()


@dataclass
class LaunchLog:
    """The launches seen inside one `record_launches()` block."""

    keys: set[Key] = field(default_factory=set)  # (kernel name, specialization), one per distinct key
    num_launches: int = 0

    def kernels(self) -> set[str]:
        """The names of the kernels launched."""
        return {name for name, _ in self.keys}


@contextmanager
def record_launches() -> Iterator[LaunchLog]:
    """Record every Triton launch (of any @triton.jit kernel) made inside the block into the yielded LaunchLog.
    Wraps the launch entry point of Triton's JIT and interpreter classes and restores it on exit; blocks may
    nest (each records). Recording costs a Python pass over the arguments per launch: for tests and checks only."""
    log = LaunchLog()
    patched = []
    with _LOCK:
        for cls in _launcher_classes():
            original = cls.__dict__["run"]
            cls.run = _recording_run(original, log)
            patched.append((cls, original))
    try:
        yield log
    finally:
        with _LOCK:
            for cls, original in reversed(patched):
                cls.run = original


def specialization_key(kernel, args: tuple, kwargs: dict) -> Key:
    """The key of one launch `kernel[grid](*args, **kwargs)` (a JITFunction or an InterpretedFunction)."""
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    bound.update((k, v) for k, v in kwargs.items() if k not in bound)
    options = getattr(kernel, "kwargs", None) or {}  # InterpretedFunction keeps the jit() arguments here
    no_value = _names(params, getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize"))
    no_align = _names(params, getattr(kernel, "do_not_specialize_on_alignment", None)
                      or options.get("do_not_specialize_on_alignment"))
    spec = []
    for p in params:
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            spec.append((p.name, "constexpr", _constexpr_value(value)))
        else:
            spec.append((p.name, *_argument_key(value, p.name not in no_value, p.name not in no_align)))
    spec.append(("num_warps", kwargs.get("num_warps")))
    spec.append(("num_stages", kwargs.get("num_stages")))
    return fn.__qualname__, tuple(spec)


def _recording_run(original, log: LaunchLog):
    def run(self, *args, grid, warmup, **kwargs):
        key = specialization_key(self, args, kwargs)
        with _LOCK:
            log.keys.add(key)
            log.num_launches += 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    return run


def _launcher_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        return classes
    return classes + [InterpretedFunction]


def _names(params: list[inspect.Parameter], entries) -> set[str]:
    """do_not_specialize entries (indices or names) as parameter names."""
    return {params[e].name if isinstance(e, int) else e for e in entries or ()}


def _argument_key(value, specialize: bool, align: bool) -> tuple:
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0 if align else None)
    if isinstance(value, bool):  # before int: bool is an int
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        return (_int_type(value), value % 16 == 0 if specialize else None)
    if isinstance(value, float):
        return ("fp32", None)
    if value is None:
        return ("constexpr", None)
    return (type(value).__name__, None)


def _int_type(value: int) -> str:
    # As triton's specialize_impl: the narrowest type that holds the value.
    if -2**31 <= value < 2**31:
        return "i32"
    if 2**31 <= value < 2**32:
        return "u32"
    if -2**63 <= value < 2**63:
        return "i64"
    return "u64"


def _constexpr_value(value):
    value = getattr(value, "value", value)  # tl.constexpr(...)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
