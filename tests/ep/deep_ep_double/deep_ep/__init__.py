"""A test double of the ``deep_ep`` package, for the adapters' tests on CPU.

Never importable by the product: only tests add ``tests/ep/deep_ep_double`` to
the import path. It follows the pinned library sources (tests/ep/deep_ep_double/
manifest.py names each signature and the commit it was read at) in what the
adapters can observe, and computes with arithmetic of its own
(``_kernels.py``, written from the library's semantics and sharing no code with
torchtitan_ext's reference kernels, which the tests compare against it):

- signatures: keyword names, defaults, keyword-only markers, return arity;
- ``DEEP_EP_DOUBLE_BUILD``: "main" (DeepEP v2.1.0: ``Buffer`` and
  ``ElasticBuffer``), "hybrid-ep" (the branch build: ``Buffer`` and
  ``HybridEPBuffer``) or "v2.5" (DeepEP V2.5: ``EPBuffer`` with its
  load-balancing kernels and ``BufferAllocator``, no v1, no ``ElasticBuffer``);
  one build never has both HybridEP and V2;
- ``DEEP_EP_DOUBLE_IMPORT_FAILURE``: "nccl" raises the NCCL binary check's
  AssertionError at import, "cuda_home" the JIT setup's;
- host vs device: what the library returns in pinned host memory comes back
  as a :class:`HostTensor`, which refuses to take part in any computation
  until it is copied to the device with ``.to(device, non_blocking=True)``;
- None where the library returns None (cached dispatches);
- dtype limits: combine kernels refuse anything but bf16 ("Unsupported
  type"); HybridEP without FP8 reads fp32 tokens as 16-bit words and returns
  garbage instead of refusing them;
- uninitialised memory: HybridEP's overflow flag in blocking mode, its
  handle's local_expert_routing_map (never written by dispatch_with_permute),
  rows past the padded total;
- asserts the adapters can trip: supported rank counts, even SM counts,
  deterministic mode, layout limits, ``num_permuted_tokens`` rules;
- lifetimes: ``Buffer`` and ``ElasticBuffer`` have ``destroy()`` (with
  ``explicitly_destroy``); destroying the process group while one is alive fails;
- the borrowed communicator: ``ElasticBuffer`` on a group that has run no
  collective gets a null NCCL communicator and fails;
- the SM estimate: ``ElasticBuffer.get_theoretical_num_sms`` (an instance
  method) divides by the bandwidths it detects, 0 with
  ``DEEP_EP_DOUBLE_DETECTED_GBPS=0`` across scale-out ranks
  (``DEEP_EP_DOUBLE_RANKS_PER_NODE``): ZeroDivisionError, as the library;
- first-use compilation: HybridEP needs ``$CUDA_HOME/bin/nvcc`` and a writable
  JIT cache folder at its first dispatch;
- library syncs: each call that makes the host wait (v1 and V2 dispatch with
  the CPU sync, blocking HybridEP) reports one through
  :data:`_double.LISTENERS`, and the adapters' own code is told apart from the
  library's by :func:`_double.inside_library`.
"""

import os

from deep_ep import _double

_double.check_import()

from deep_ep._buffers import EventHandle, EventOverlap, topk_idx_t  # noqa: E402,F401

__version__ = {"main": "2.1.0", "hybrid-ep": "1.2.1+hybrid-ep", "v2.5": "2.5.0"}.get(_double.BUILD)

if _double.BUILD == "main":
    from deep_ep._buffers import Buffer, Config, ElasticBuffer, EPHandle  # noqa: E402,F401
elif _double.BUILD == "hybrid-ep":
    from deep_ep._buffers import Buffer, Config  # noqa: E402,F401
    from deep_ep._hybrid import HybridEPBuffer, indices_to_map  # noqa: E402,F401
elif _double.BUILD == "v2.5":
    from deep_ep._ep_buffer import (  # noqa: E402,F401
        BufferAllocator, EPBuffer, EPHandle, get_num_allocation_alignment, get_num_tma_alignment,
        get_physical_domain_size,
    )
else:
    raise ImportError(
        f"DEEP_EP_DOUBLE_BUILD={os.environ.get('DEEP_EP_DOUBLE_BUILD')!r}: use 'main', 'hybrid-ep' or 'v2.5'"
    )
