"""What a machine needs before deep_ep builds, imports and runs, read off the pinned sources.

Each check names the requirement, what this machine has, and the fix; the
sources it follows are DeepEP main ``dd758caf`` (setup.py, deep_ep/__init__.py,
deep_ep/utils/find_pkgs.py, README.md), DeepEP V2.5's README (``93eb6eb2``) and
the hybrid-ep branch ``94a9f8f6`` (setup.py, csrc/hybrid_ep/jit/compiler.cu,
docs/README_Hybrid-EP.md).
python -m torchtitan_ext.bench cluster_check prints them on any machine; the HybridEP backend runs
:func:`check_hybridep_jit` in the job's validation.
"""

import importlib.metadata
import os
import pwd
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ext.ep.kernels import import_library, KernelUnavailable

MIN_NCCL_FOR_ELASTIC = (2, 30, 4)
"""DeepEP main's README: V2 runs on NCCL's Gin backend from 2.30.4 (torch 2.13's wheels bundle 2.29.7)."""

MIN_NCCL_FOR_EP_BUFFER = (2, 32, 3)
"""DeepEP V2.5's README: "NCCL 2.32.3 and above"."""

MIN_NVSHMEM = (3, 3, 9)
"""DeepEP main's docs/nvshmem.md."""


class PrerequisiteMissing(RuntimeError):
    """A requirement of the kernels that this machine does not meet; the message names it and the fix."""


@dataclass(frozen=True)
class Check:
    """One requirement: ``status`` is "ok", "missing" or "not checkable here"."""

    requirement: str
    status: str
    detail: str


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _shown(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _pip_package(prefix: str) -> tuple[str, str] | None:
    """(name, version) of an installed NVIDIA wheel whose name starts with ``prefix`` (any CUDA suffix)."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(prefix):
            return name, dist.version
    return None


def _root_from_env(name: str) -> tuple[str, str] | None:
    """DeepEP's find_pkgs order: ``EP_<NAME>_ROOT_DIR``, then ``<NAME>_DIR``, before any pip wheel."""
    for variable in (f"EP_{name}_ROOT_DIR", f"{name}_DIR"):
        if variable in os.environ:
            return variable, os.environ[variable]
    return None


def _writable_folder(path: Path) -> bool:
    """Whether ``path`` can be created or written: its nearest existing ancestor is a writable folder."""
    existing = next((folder for folder in (path, *path.parents) if folder.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


def password_home() -> str | None:
    """The home the C++ side reads (``getpwuid``), which ignores ``$HOME``."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or None
    except KeyError:
        return None


def hybridep_jit_folder() -> Path:
    """Where HybridEP's first dispatch writes its kernels (compiler.cu ``get_jit_dir``), without the
    per-process ``proc-<pid>`` leaf: the library adds it, so no job finds another job's kernels."""
    base = os.environ.get("HYBRID_EP_CACHE_DIR") or password_home() or "/tmp"
    return Path(base) / ".deepep" / "hybrid_ep" / "jit"


def check_hybridep_jit() -> None:
    """HybridEP compiles its kernels at the first dispatch, on every rank, with ``$CUDA_HOME/bin/nvcc``
    (no other lookup) into :func:`hybridep_jit_folder`: PrerequisiteMissing if either would fail there."""
    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = Path(cuda_home or "") / "bin" / "nvcc"
    if not cuda_home or not os.access(nvcc, os.X_OK):
        raise PrerequisiteMissing(
            f"HybridEP compiles its kernels at the first dispatch with $CUDA_HOME/bin/nvcc, and {nvcc} is not an "
            f"executable (CUDA_HOME={cuda_home or 'unset'!r}): set CUDA_HOME to the CUDA toolkit deep_ep was built with"
        )
    folder = hybridep_jit_folder()
    if not _writable_folder(folder):
        raise PrerequisiteMissing(
            f"HybridEP writes its compiled kernels under {folder}, which is not a writable folder: set "
            "HYBRID_EP_CACHE_DIR to a writable folder"
        )


def _cuda_toolkit() -> Check:
    """DeepEP main's JIT: CUDA_HOME, else CUDA_PATH, else the folder above ``which nvcc``, else
    /usr/local/cuda (deep_ep/__init__.py find_cuda_home); HybridEP reads CUDA_HOME only."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    on_path = shutil.which("nvcc")
    if home is None and on_path:
        home = str(Path(on_path).parent.parent)
    if home is None and Path("/usr/local/cuda").exists():
        home = "/usr/local/cuda"
    nvcc = Path(home or "") / "bin" / "nvcc"
    if home is None or not os.access(nvcc, os.X_OK):
        return Check("CUDA toolkit (nvcc, for the kernels compiled at first use)", "missing",
                     "no nvcc under CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda: install the CUDA toolkit "
                     "(12.3+ for DeepEP main v2.1, 13.1+ for V2.5) and set CUDA_HOME")
    if not os.environ.get("CUDA_HOME"):
        return Check("CUDA toolkit (nvcc, for the kernels compiled at first use)", "missing",
                     f"{nvcc} found, enough for DeepEP main, but HybridEP reads CUDA_HOME only: export CUDA_HOME={home}")
    return Check("CUDA toolkit (nvcc, for the kernels compiled at first use)", "ok", str(nvcc))


def _nccl(minimum: tuple[int, ...], build: str) -> Check:
    requirement = f"NCCL >= {_shown(minimum)} ({build})"
    from_env = _root_from_env("NCCL")
    if from_env is not None:
        variable, root = from_env
        header = Path(root) / "include" / "nccl.h"
        if not header.is_file():
            return Check(requirement, "missing", f"{variable}={root} has no include/nccl.h")
        text = header.read_text(errors="replace")
        parts = [re.search(rf"#define NCCL_{key}\s+(\d+)", text) for key in ("MAJOR", "MINOR", "PATCH")]
        if not all(parts):
            return Check(requirement, "missing", f"{header} defines no NCCL_MAJOR/MINOR/PATCH")
        version = tuple(int(part.group(1)) for part in parts)
        where = f"{variable}={root}"
    else:
        package = _pip_package("nvidia-nccl-cu")
        if package is None:
            return Check(requirement, "missing",
                         f'no NCCL wheel and no EP_NCCL_ROOT_DIR/NCCL_DIR: pip install "nvidia-nccl-cu13>={_shown(minimum)}" '
                         "--no-deps")
        version, where = _version(package[1]), f"pip {package[0]} {package[1]}"
    if version < minimum:
        return Check(requirement, "missing", f"{where} is {_shown(version)}: pip install "
                     f'"nvidia-nccl-cu13>={_shown(minimum)}" --no-deps (it replaces the NCCL torch loads; '
                     "--no-deps keeps pip from changing torch)")
    return Check(requirement, "ok", where)


def _nvshmem() -> Check:
    requirement = f"NVSHMEM >= {_shown(MIN_NVSHMEM)} (DeepEP main v2.1's build, for the v1 API's internode kernels; V2.5 needs none)"
    from_env = _root_from_env("NVSHMEM")
    if from_env is not None:
        variable, root = from_env
        if not (Path(root) / "include").is_dir():
            return Check(requirement, "missing", f"{variable}={root} has no include/ folder")
        return Check(requirement, "ok", f"{variable}={root} (version not read: check it is {_shown(MIN_NVSHMEM)}+)")
    package = _pip_package("nvidia-nvshmem-cu")
    if package is None:
        return Check(requirement, "missing",
                     "no nvidia-nvshmem wheel and no EP_NVSHMEM_ROOT_DIR/NVSHMEM_DIR: pip install nvidia-nvshmem-cu12 "
                     "(or cu13, matching the CUDA toolkit)")
    if _version(package[1]) < MIN_NVSHMEM:
        return Check(requirement, "missing", f"pip {package[0]} {package[1]}: upgrade to {_shown(MIN_NVSHMEM)}+")
    return Check(requirement, "ok", f"pip {package[0]} {package[1]}")


def _jit_caches() -> Check:
    """EP_JIT_CACHE_DIR, else DeepEP main's default ~/.deep_ep and V2.5's (DeepJIT's) ~/.dj; HybridEP's folder."""
    configured = os.environ.get("EP_JIT_CACHE_DIR")
    if configured:
        caches = {"EP_JIT_CACHE_DIR": Path(configured)}
    else:
        caches = {"DeepEP main v2.1's default": Path.home() / ".deep_ep", "DeepEP V2.5's default": Path.home() / ".dj"}
    problems = [f"{folder} ({what}; set EP_JIT_CACHE_DIR)" for what, folder in caches.items()
                if not _writable_folder(folder)]
    if not _writable_folder(hybridep_jit_folder()):
        problems.append(f"{hybridep_jit_folder()} (HybridEP; set HYBRID_EP_CACHE_DIR)")
    if problems:
        return Check("writable kernel caches", "missing", "not writable: " + "; ".join(problems))
    folders = ", ".join(str(folder) for folder in caches.values())
    return Check("writable kernel caches", "ok", f"{folders}, {hybridep_jit_folder()}/proc-<pid>")


def _hybridep_multinode() -> Check:
    """Read from the environment the build ran in (the source tree's setup.py reads the same variables)."""
    requirement = "multi-node HybridEP build (NIXL or DOCA)"
    if os.environ.get("HYBRID_EP_MULTINODE") != "1":
        return Check(requirement, "ok", "HYBRID_EP_MULTINODE unset: a build for one NVLink domain "
                     "(build with HYBRID_EP_MULTINODE=1 and NIXL or DOCA when an EP group spans NVLink domains)")
    if os.environ.get("USE_NIXL") == "1":
        missing = [f"{name} ({os.environ.get(name, 'unset')})" for name in ("NIXL_HOME", "UCX_HOME")
                   if not (Path(os.environ.get(name, "/nonexistent")) / "include").is_dir()]
        if missing:
            return Check(requirement, "missing", f"USE_NIXL=1 but no include/ under {', '.join(missing)}")
        if "NIXL_ETCD_ENDPOINTS" not in os.environ:
            return Check(requirement, "missing", "NIXL exchanges metadata through etcd: start etcd on one node and "
                         "export NIXL_ETCD_ENDPOINTS=http://<node>:2379 on every rank")
        return Check(requirement, "ok", f"NIXL at {os.environ['NIXL_HOME']}, etcd {os.environ['NIXL_ETCD_ENDPOINTS']}")
    rdma = os.environ.get("RDMA_CORE_HOME")
    if not rdma or not Path(rdma).is_dir():
        return Check(requirement, "missing", f"the DOCA path needs RDMA_CORE_HOME (rdma-core v60.0 build), now "
                     f"{rdma or 'unset'}; or build with USE_NIXL=1")
    return Check(requirement, "ok", f"DOCA, RDMA_CORE_HOME={rdma}")


def _library() -> Check:
    try:
        library = import_library()
    except KernelUnavailable as e:
        return Check("deep_ep importable", "missing", str(e))
    classes = [name for name in ("Buffer", "ElasticBuffer", "EPBuffer", "HybridEPBuffer") if hasattr(library, name)]
    return Check("deep_ep importable", "ok",
                 f"{getattr(library, '__version__', '(no __version__)')}: {', '.join(classes) or 'no buffer class'}")


def _nvml() -> Check:
    requirement = "pynvml (the hybrid-ep build's v1 Buffer checks NVLink pairs with it)"
    try:
        importlib.import_module("pynvml")
    except ImportError:
        return Check(requirement, "missing", "pip install nvidia-ml-py (needed for deepep api = 'legacy' on the "
                     "hybrid-ep build only)")
    return Check(requirement, "ok", "importable")


def machine_checks(cuda_available: bool) -> list[Check]:
    """Every check; what only a GPU can tell is listed as such where there is none."""
    checks = [
        _cuda_toolkit(), _nccl(MIN_NCCL_FOR_ELASTIC, "DeepEP main v2.1, V2's Gin backend"),
        _nccl(MIN_NCCL_FOR_EP_BUFFER, "DeepEP V2.5"), _nvshmem(), _jit_caches(), _hybridep_multinode(), _nvml(),
        _library(),
    ]
    if not cuda_available:
        checks.append(Check("GPUs, NVLink, RDMA, the NCCL torch actually loads, the kernels", "not checkable here",
                            "no CUDA device: run this on a GPU node"))
    return checks
