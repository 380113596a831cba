"""Each backend's custom ops (``torchtitan_ext::<backend>_dispatch`` ...) with their autograd.

Imported by a backend when it first builds a layer or names its ops for
selective activation checkpointing, so that reading a config registers no op.
"""
