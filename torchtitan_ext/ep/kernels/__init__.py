"""Kernel implementations behind the DeepEP and HybridEP backends.

Two implementations of the same calls:

- ``deep_ep``: the real library (CUDA only, built from source), imported lazily;
- ``reference``: :mod:`torchtitan_ext.ep.kernels.reference`, pure torch.distributed,
  on any device.

``auto`` picks ``deep_ep`` on CUDA and ``reference`` on CPU; on CUDA without
the library it is an error, never a silent fallback.
"""

import importlib

IMPLEMENTATIONS = ("auto", "deep_ep", "reference")

LIBRARY_CLASS = {"deepep": "Buffer", "hybridep": "HybridEPBuffer"}
"""The deep_ep class each backend needs; HybridEPBuffer exists only in the hybrid-ep branch build."""

INSTALL_HINT = {
    "deepep": "build DeepEP from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
    "hybridep": "build DeepEP's hybrid-ep branch from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
}


class KernelUnavailable(RuntimeError):
    """The requested kernel implementation cannot run here; the message says why and what to do."""


def resolve_implementation(backend: str, implementation: str, device_type: str) -> str:
    """``"deep_ep"`` or ``"reference"`` for ``[backend] implementation`` on this device.

    Raises ``KernelUnavailable`` naming the field and the fix when the library
    is needed but cannot be used.
    """
    if implementation not in IMPLEMENTATIONS:
        raise KernelUnavailable(
            f"{backend}.implementation = '{implementation}': use one of {', '.join(IMPLEMENTATIONS)}"
        )
    if implementation == "auto":
        implementation = "deep_ep" if device_type == "cuda" else "reference"
    if implementation == "reference":
        return implementation
    if device_type != "cuda":
        raise KernelUnavailable(
            f"{backend}.implementation = 'deep_ep' needs CUDA, and this machine has none: "
            "use implementation = 'reference' (or 'auto') on CPU"
        )
    class_name = LIBRARY_CLASS[backend]
    try:
        library = importlib.import_module("deep_ep")
        getattr(library, class_name)
    except (ImportError, AttributeError) as e:
        raise KernelUnavailable(
            f"{backend}.implementation resolves to the deep_ep library on CUDA, but "
            f"deep_ep.{class_name} cannot be imported ({e}): {INSTALL_HINT[backend]}, or set "
            f"{backend}.implementation = 'reference' to run the (slow) reference kernels"
        ) from None
    return implementation


def implementation_description(implementation: str) -> str:
    """How ``implementation`` resolves, for reports made before the device is known."""
    if implementation == "auto":
        return "auto (deep_ep on CUDA, reference on CPU)"
    return implementation


def deep_ep_unavailable_reason(backend: str) -> str | None:
    """Why the real library for ``backend`` cannot run here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        resolve_implementation(backend, "deep_ep", "cuda")
    except KernelUnavailable as e:
        return str(e)
    return None
