"""Each backend's custom ops (``torchtitan_ext::<backend>_dispatch`` ...) with their autograd.

Imported by a backend when it first builds a layer or names its ops for
selective activation checkpointing, so that reading a config registers no op.
The ops take and return opaque objects (dispatch handles, in-flight landings),
which custom ops accept from torch 2.11 on (``opaque_schema``): an older torch
is refused here in one line rather than deep inside op registration.
"""

import re

import torch

OPAQUE_ARGUMENTS_SINCE = (2, 11)


def require_opaque_arguments(torch_version: str) -> None:
    """``torch_version`` as torch spells it ("2.11.0+cu130", "2.13.0.dev20261101"): only major.minor is read."""
    major_minor = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    if major_minor < OPAQUE_ARGUMENTS_SINCE:
        raise ImportError(
            f"torch {torch_version} is installed, but torchtitan_ext's EP ops pass opaque objects, which "
            f"custom ops accept from torch 2.11 on: pip install torch==2.13.0 (the build for this machine)"
        )


require_opaque_arguments(torch.__version__)
