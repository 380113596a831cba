"""Machine prerequisites of deep_ep: each check says ok or missing with the fix, read from the environment
the way the pinned sources read it (find_pkgs.py's variable order, compiler.cu's CUDA_HOME and cache folder)."""

import os
import stat

import pytest

from torchtitan_ext.ep.kernels import prerequisites
from torchtitan_ext.ep.kernels.prerequisites import check_hybridep_jit, machine_checks, PrerequisiteMissing


def _check(name: str):
    return next(check for check in machine_checks(cuda_available=False) if check.requirement.startswith(name))


def _toolkit(folder):
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    for variable in ("CUDA_HOME", "CUDA_PATH", "EP_NCCL_ROOT_DIR", "NCCL_DIR", "EP_NVSHMEM_ROOT_DIR", "NVSHMEM_DIR",
                     "HYBRID_EP_MULTINODE", "USE_NIXL", "NIXL_HOME", "UCX_HOME", "NIXL_ETCD_ENDPOINTS", "RDMA_CORE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no_tools"))
    monkeypatch.setenv("HYBRID_EP_CACHE_DIR", str(tmp_path / "hybrid_cache"))
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "main_cache"))
    return tmp_path


def test_cuda_toolkit(clean_environment, monkeypatch):
    toolkit = _toolkit(clean_environment / "cuda")
    monkeypatch.setenv("PATH", str(toolkit / "bin"))
    found_on_path = _check("CUDA toolkit")
    assert found_on_path.status == "missing", found_on_path
    assert f"HybridEP reads CUDA_HOME only: export CUDA_HOME={toolkit}" in found_on_path.detail
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert _check("CUDA toolkit").status == "ok"


def test_deepep_v2_5_needs_a_newer_nccl(clean_environment, monkeypatch):
    """DeepEP V2.5's README asks NCCL 2.32.3; 2.30.4 is enough for main v2.1 only."""
    include = clean_environment / "nccl" / "include"
    include.mkdir(parents=True)
    (include / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH 4\n")
    monkeypatch.setenv("NCCL_DIR", str(clean_environment / "nccl"))
    assert _check("NCCL >= 2.30.4 (DeepEP main v2.1").status == "ok"
    check = _check("NCCL >= 2.32.3 (DeepEP V2.5)")
    assert check.status == "missing" and 'is 2.30.4: pip install "nvidia-nccl-cu13>=2.32.3" --no-deps' in check.detail


@pytest.mark.parametrize("patch, status", [(7, "missing"), (4, "ok")])
def test_nccl_version_from_the_header_named_by_nccl_dir(clean_environment, monkeypatch, patch, status):
    include = clean_environment / "nccl" / "include"
    include.mkdir(parents=True)
    (include / "nccl.h").write_text(
        f"#define NCCL_MAJOR 2\n#define NCCL_MINOR {29 if patch == 7 else 30}\n#define NCCL_PATCH {patch}\n")
    monkeypatch.setenv("NCCL_DIR", str(clean_environment / "nccl"))
    check = _check("NCCL")
    assert check.status == status, check
    if status == "missing":
        assert "is 2.29.7: pip install \"nvidia-nccl-cu13>=2.30.4\" --no-deps" in check.detail


def test_ep_nccl_root_dir_comes_before_nccl_dir(clean_environment, monkeypatch):
    """find_pkgs.py reads EP_NCCL_ROOT_DIR first."""
    monkeypatch.setenv("EP_NCCL_ROOT_DIR", str(clean_environment / "first"))
    monkeypatch.setenv("NCCL_DIR", str(clean_environment / "second"))
    assert "EP_NCCL_ROOT_DIR=" in _check("NCCL").detail


def test_nvshmem_root_without_headers(clean_environment, monkeypatch):
    monkeypatch.setenv("NVSHMEM_DIR", str(clean_environment))
    check = _check("NVSHMEM")
    assert check.status == "missing" and "has no include/ folder" in check.detail, check
    (clean_environment / "include").mkdir()
    assert _check("NVSHMEM").status == "ok"


def test_multinode_hybridep_names_its_missing_piece(clean_environment, monkeypatch):
    assert _check("multi-node HybridEP").status == "ok"
    monkeypatch.setenv("HYBRID_EP_MULTINODE", "1")
    assert "the DOCA path needs RDMA_CORE_HOME" in _check("multi-node HybridEP").detail
    monkeypatch.setenv("USE_NIXL", "1")
    assert "USE_NIXL=1 but no include/ under NIXL_HOME (unset), UCX_HOME (unset)" in _check("multi-node HybridEP").detail
    for name in ("nixl", "ucx"):
        (clean_environment / name / "include").mkdir(parents=True)
    monkeypatch.setenv("NIXL_HOME", str(clean_environment / "nixl"))
    monkeypatch.setenv("UCX_HOME", str(clean_environment / "ucx"))
    assert "export NIXL_ETCD_ENDPOINTS=http://<node>:2379 on every rank" in _check("multi-node HybridEP").detail
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "http://node01:2379")
    assert _check("multi-node HybridEP").status == "ok"


def test_kernel_caches_must_be_folders(clean_environment, monkeypatch):
    assert _check("writable kernel caches").status == "ok"
    (clean_environment / "a_file").write_text("")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(clean_environment / "a_file" / "cache"))
    check = _check("writable kernel caches")
    assert check.status == "missing" and "(EP_JIT_CACHE_DIR; set EP_JIT_CACHE_DIR)" in check.detail, check


def test_unset_kernel_cache_means_each_builds_default(clean_environment, monkeypatch):
    """Without EP_JIT_CACHE_DIR, DeepEP main v2.1 compiles into ~/.deep_ep and V2.5 (DeepJIT) into ~/.dj."""
    monkeypatch.delenv("EP_JIT_CACHE_DIR")
    home = clean_environment / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    check = _check("writable kernel caches")
    assert check.status == "ok" and check.detail.startswith(f"{home / '.deep_ep'}, {home / '.dj'}, "), check


def test_hybridep_jit_reads_cuda_home_only(clean_environment, monkeypatch):
    """compiler.cu builds the nvcc path from CUDA_HOME; nvcc on PATH does not count."""
    toolkit = _toolkit(clean_environment / "cuda")
    monkeypatch.setenv("PATH", str(toolkit / "bin") + os.pathsep + os.environ["PATH"])
    with pytest.raises(PrerequisiteMissing, match=r"CUDA_HOME='unset'\): set CUDA_HOME to the CUDA toolkit"):
        check_hybridep_jit()
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    check_hybridep_jit()


@pytest.mark.parametrize("database_home, expected", [("/home/from-the-database", "/home/from-the-database"),
                                                     ("", "/tmp"), (None, "/tmp")])
def test_hybridep_jit_folder_ignores_home(clean_environment, monkeypatch, database_home, expected):
    """The C++ side takes the home from the password database (getpwuid), not $HOME; /tmp where the database gives
    none (an empty entry, or no entry for the user: KeyError)."""
    import pwd

    def getpwuid(uid):
        if database_home is None:
            raise KeyError(uid)
        return pwd.struct_passwd(("user", "x", uid, uid, "", database_home, "/bin/sh"))

    monkeypatch.delenv("HYBRID_EP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(clean_environment / "elsewhere"))
    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    assert str(prerequisites.hybridep_jit_folder()) == f"{expected}/.deepep/hybrid_ep/jit"


def test_without_cuda_the_gpu_side_is_not_checkable(clean_environment):
    last = machine_checks(cuda_available=False)[-1]
    assert last.status == "not checkable here", last
    assert all(check.status != "not checkable here" for check in machine_checks(cuda_available=True))
