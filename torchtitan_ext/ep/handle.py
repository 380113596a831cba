"""Opaque objects that flow through the backends' custom ops.

A kernel library's dispatch handle and its communication buffer are not
tensors. torch 2.13 lets custom ops take and return them as opaque
reference-typed objects, so the handle lives in the autograd graph (and in
selective activation checkpointing's cache) for exactly as long as the
tensors that need it: no global handle cache that can grow.
"""

from torch._library.opaque_object import OpaqueBase, register_opaque_type


class DispatchHandle(OpaqueBase):
    """What a dispatch returns for its combine and backward: the library's handle."""

    def __init__(self, value=None):
        self.value = value


class KernelBuffer(OpaqueBase):
    """A communication buffer (deep_ep's or the reference's), shared by all MoE layers."""

    def __init__(self, value=None):
        self.value = value


register_opaque_type(DispatchHandle, typ="reference")
register_opaque_type(KernelBuffer, typ="reference")
