"""What the EP benchmarks call what they time: every backend variant of the table
(:mod:`torchtitan_ext.ep.backends`), each on the reference kernels or, with ``_lib``, on the real library's, and
``upstream``, torchtitan 0.2.2's own ExpertParallel; and the job-config overrides each label runs with."""

from torchtitan_ext.ep.backends import BACKENDS, backend_variants, variant_backend

UPSTREAM = "upstream"
"""The --backends label of torchtitan 0.2.2's own ExpertParallel."""

LIBRARY = "_lib"
"""Suffix of a variant's label on the real library's kernels."""


def kernel_section(backend: str) -> str | None:
    """The config section whose ``implementation`` picks backend ``backend``'s kernels; None if it has none."""
    return BACKENDS[backend].config_section if BACKENDS[backend].library_implementation else None


def labels() -> list[str]:
    """What --backends takes: every backend variant, each with a kernel choice also with ``_lib``, and upstream."""
    variants = list(backend_variants())
    return [*variants, *(v + LIBRARY for v in variants if kernel_section(variant_backend(v))), UPSTREAM]


def job_args(label: str) -> list[str]:
    """The job-config overrides that ``label`` (of --backends, not upstream) runs with: its variant's, and its
    kernels (the real library's for ``_lib``, else the reference) where the backend has that choice."""
    variant = label.removesuffix(LIBRARY)
    args = backend_variants()[variant]
    section = kernel_section(variant_backend(variant))
    if section is not None:
        library = BACKENDS[variant_backend(variant)].library_implementation
        args = [*args, f"--{section}.implementation", library if label.endswith(LIBRARY) else "reference"]
    return args
