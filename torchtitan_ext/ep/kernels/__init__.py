"""Kernel implementations behind the DeepEP, HybridEP and NCCL EP backends.

Each library's calls have two implementations:

- DeepEP and HybridEP: ``deep_ep``, the real library (CUDA only, built from source; :mod:`.deep_ep`,
  :mod:`.deepep_apis`), imported lazily, and :mod:`.reference`, pure torch.distributed, on any device;
- NCCL EP: :mod:`.nccl_ep` makes its facade's calls on the nccl-extensions wheel (CUDA) or on its double
  (:mod:`.nccl_ep_double`, torch.distributed, on any device).

A backend's ``implementation`` field chooses: :data:`IMPLEMENTATIONS` for DeepEP and HybridEP, NCCL EP's own
(:data:`.nccl_ep.IMPLEMENTATIONS`) for ``ncclep``. ``auto`` picks the real library on CUDA and the stand-in on
CPU; on CUDA without the library it is an error, never a silent fallback. :mod:`.calls` announces each call into a library with the host syncs it makes;
:mod:`.prerequisites` says what a machine needs before deep_ep builds.
"""

import importlib

IMPLEMENTATIONS = ("auto", "deep_ep", "reference")

LIBRARY_DEVICE_TYPE = "cuda"
"""The device the real library runs on (a test double stands in for it elsewhere)."""

INSTALL_HINT = {
    "Buffer": "build DeepEP from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
    "ElasticBuffer": "build DeepEP main (v2.1+) from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
    "EPBuffer": "build DeepEP V2.5 (main after v2.1) from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
    "HybridEPBuffer": "build DeepEP's hybrid-ep branch from source on this CUDA machine (docs/backends.md#installing-deep_ep)",
}


class KernelUnavailable(RuntimeError):
    """The requested kernel implementation cannot run here; the message says why and what to do."""


def uses_library(implementation: str, device_type: str | None) -> bool:
    """Whether ``[backend] implementation`` means the real library on ``device_type``
    (None: a machine not known yet, e.g. a dry run for a cluster, where ``auto`` means the library)."""
    if implementation == "auto":
        return device_type != "cpu"
    return implementation == "deep_ep"


def import_library():
    """``deep_ep``, or KernelUnavailable with the reason.

    Importing DeepEP main runs an NCCL binary check (AssertionError) and JIT
    setup (AssertionError without a CUDA home, RuntimeError, ImportError of its
    extension); any of them means the library cannot be used here.
    """
    try:
        return importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001 - every failure of the import is the same answer
        raise KernelUnavailable(f"import deep_ep failed: {type(e).__name__}: {e}") from None


def library_has(class_name: str) -> bool:
    """Whether the importable ``deep_ep`` exports ``class_name`` (False when it cannot be imported)."""
    try:
        return hasattr(import_library(), class_name)
    except KernelUnavailable:
        return False


def resolve_implementation(backend: str, implementation: str, device_type: str, class_name: str) -> str:
    """``"deep_ep"`` or ``"reference"`` for ``[backend] implementation`` on this device.

    ``class_name``: the deep_ep class the backend will use. Raises
    ``KernelUnavailable`` naming the field and the fix when the library is
    needed but cannot be used.
    """
    if implementation not in IMPLEMENTATIONS:
        raise KernelUnavailable(
            f"{backend}.implementation = '{implementation}': use one of {', '.join(IMPLEMENTATIONS)}"
        )
    if not uses_library(implementation, device_type):
        return "reference"
    if device_type != LIBRARY_DEVICE_TYPE:
        raise KernelUnavailable(
            f"{backend}.implementation = 'deep_ep' needs CUDA, and this machine has none: "
            "use implementation = 'reference' (or 'auto') on CPU"
        )
    try:
        missing = "" if hasattr(import_library(), class_name) else f"the installed deep_ep has no {class_name}"
    except KernelUnavailable as e:
        missing = str(e)
    if missing:
        raise KernelUnavailable(
            f"{backend}.implementation resolves to the deep_ep library on CUDA, but {missing}: "
            f"{INSTALL_HINT[class_name]}, or set {backend}.implementation = 'reference' to run the (slow) "
            "reference kernels"
        )
    return "deep_ep"


def implementation_description(implementation: str) -> str:
    """How ``implementation`` resolves, for reports made before the device is known."""
    if implementation == "auto":
        return "auto (deep_ep on CUDA, reference on CPU)"
    return implementation


def deep_ep_unavailable_reason(backend: str, class_name: str) -> str | None:
    """Why the real library class for ``backend`` cannot run here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        resolve_implementation(backend, "deep_ep", "cuda", class_name)
    except KernelUnavailable as e:
        return str(e)
    return None
