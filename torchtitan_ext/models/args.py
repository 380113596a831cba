"""Our model-args classes built from torchtitan's: each subclass adds methods only, so a flavour converts field by
field (torchtitan's flavours, and a Hugging Face config.json's arguments read as an ``hf:`` flavour)."""

import dataclasses


def as_our_args(args_class: type, upstream):
    """``upstream``, one flavour's torchtitan model args, as ``args_class`` (a subclass of its class)."""
    return args_class(**{field.name: getattr(upstream, field.name) for field in dataclasses.fields(upstream)})
