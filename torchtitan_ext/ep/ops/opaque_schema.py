"""Custom ops that return opaque objects (dispatch handles, in-flight landings), on torch 2.11 and later.

torch 2.11 and 2.12 take opaque objects as custom-op arguments but infer no schema
for an op that returns one (2.13 does). Such ops are registered here with their
schema spelled out, the arguments inferred by torch and the returns named as
torch 2.13 names them, so every supported torch registers the same op.
"""

import inspect
import typing

import torch
from torch._library.opaque_object import get_opaque_type_name, is_opaque_reference_type

_RETURN_TYPES = {torch.Tensor: "Tensor", list[torch.Tensor]: "Tensor[]", typing.List[torch.Tensor]: "Tensor[]",
                 int: "SymInt", float: "float", bool: "bool"}
"""What ``torch.library.infer_schema`` names each non-opaque return type."""


def _return_schema(annotation) -> str:
    def named(return_type) -> str:
        if is_opaque_reference_type(return_type):
            return get_opaque_type_name(return_type)
        if return_type not in _RETURN_TYPES:
            raise TypeError(f"a custom op returning {return_type}: return tensors, numbers or opaque reference types")
        return _RETURN_TYPES[return_type]

    if annotation in (None, type(None)):
        return "()"
    if typing.get_origin(annotation) is not tuple:
        return named(annotation)
    names = ", ".join(named(return_type) for return_type in typing.get_args(annotation))
    return f"(({names}))" if len(typing.get_args(annotation)) == 1 else f"({names})"


def op_schema(function, mutates_args: tuple[str, ...]) -> str:
    """``function``'s schema, as torch 2.13's ``infer_schema`` writes it, on any torch from 2.11."""
    signature = inspect.signature(function)

    def arguments_only():
        raise NotImplementedError

    arguments_only.__signature__ = signature.replace(return_annotation=None)
    inferred = torch.library.infer_schema(arguments_only, mutates_args=mutates_args)
    return inferred.removesuffix("-> ()") + "-> " + _return_schema(typing.get_type_hints(function)["return"])


def custom_op_returning_opaque(name: str, mutates_args: tuple[str, ...] = ()):
    """``torch.library.custom_op(name, mutates_args=...)`` for an op whose returns hold an opaque object."""

    def register(function):
        return torch.library.custom_op(name, function, mutates_args=mutates_args,
                                       schema=op_schema(function, mutates_args))

    return register
