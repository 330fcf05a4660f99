"""Kernels of the model's forward pass: a torch reference (the spec and the CPU path) and a Triton kernel per op.

Each dispatch function runs Triton when its input is on CUDA and, otherwise, a C kernel where one exists
(kernels/cpu/: decode attention, the float32 linear) or the reference."""
if __name__ == "kernels":
    # NOTE: run from the checkout, `import kernels` finds this folder under the name of the HF Kernel
    # Hub package, which transformers and vLLM import. Where that package is installed (transformers
    # >= 5.25 requires it), load it in this module's place: the import system hands back whatever
    # sys.modules holds once this file has run. Where it is not, transformers' probe
    # (`_is_package_available`) imports whatever `kernels` it finds and counts a module with neither
    # `__version__` nor `__file__` as absent (a namespace-package shadow), so this folder becomes such
    # an empty shadow: no `__file__`, no names, nothing importable below it.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _checkout]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.origin is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        try:
            _spec.loader.exec_module(_module)
        except BaseException:
            del _sys.modules["kernels"]
            raise
    else:
        __file__ = None
        __path__ = []
else:
    from lightserve.kernels.activation import (
        gelu_tanh_and_mul,
        gelu_tanh_and_mul_ref,
        silu_and_mul,
        silu_and_mul_ref,
    )
    from lightserve.kernels.decode_attention import decode_attention, decode_attention_ref
    from lightserve.kernels.kv_store import store_kv, store_kv_ref
    from lightserve.kernels.linear import (
        PackedLinear,
        PrepackedLinear,
        linear,
        linear_ref,
        onednn_available,
        pack_linear_weight,
        prepack_weight,
    )
    from lightserve.kernels.prefill_attention import (
        prefill_attention,
        prefill_attention_ref,
    )
    from lightserve.kernels.rmsnorm import (
        add_rmsnorm,
        add_rmsnorm_ref,
        rmsnorm,
        rmsnorm_ref,
    )
    from lightserve.kernels.rotary import rotary_emb, rotary_emb_ref

    __all__ = [
        "PrepackedLinear", "PackedLinear", "add_rmsnorm", "add_rmsnorm_ref", "decode_attention", "decode_attention_ref",
        "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref",
        "linear", "linear_ref", "onednn_available", "pack_linear_weight", "prefill_attention", "prepack_weight",
        "prefill_attention_ref", "rmsnorm", "rmsnorm_ref", "rotary_emb", "rotary_emb_ref", "silu_and_mul",
        "silu_and_mul_ref", "store_kv", "store_kv_ref",
    ]
