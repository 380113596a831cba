# Sourced by run_train.sh, test.sh and multinode_trainer.slurm: makes `python` one that can
# import torchtitan_ext.
#
# - If the active environment already has torchtitan_ext (a cluster install,
#   `pip install -e .`), it is used as is.
# - Otherwise a virtual environment is created in .venv on first use:
#   torch 2.13.0 first (on a machine without CUDA that is the CPU build), then
#   this package with its test extras. Later runs reuse it.
#
# PYTHON selects the interpreter used to create .venv (default: python3).

_tte_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_tte_venv="${TORCHTITAN_EXT_VENV:-${_tte_root}/.venv}"

_tte_has_package() {
    "$1" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torchtitan_ext') and u.find_spec('torchtitan')))" >/dev/null 2>&1
}

if command -v python >/dev/null 2>&1 && _tte_has_package python; then
    TTE_PYTHON="$(command -v python)"
elif [ -x "${_tte_venv}/bin/python" ] && _tte_has_package "${_tte_venv}/bin/python"; then
    TTE_PYTHON="${_tte_venv}/bin/python"
else
    echo "[env] creating ${_tte_venv} (first use; installs torch 2.13.0, torchtitan 0.2.2 and test tools)" >&2
    "${PYTHON:-python3}" -m venv "${_tte_venv}" || {
        echo "error: could not create a virtual environment with ${PYTHON:-python3}: install python3-venv or set PYTHON" >&2
        exit 2
    }
    "${_tte_venv}/bin/python" -m pip install --quiet --upgrade pip >&2
    # torch first and pinned: anything that pulls an unpinned torch would fetch a multi-GB CUDA build.
    "${_tte_venv}/bin/python" -m pip install --quiet "torch==2.13.0" >&2 || {
        echo "error: pip could not install torch==2.13.0: check the package index or install torch yourself" >&2
        exit 2
    }
    "${_tte_venv}/bin/python" -m pip install --quiet -e "${_tte_root}[test,plots]" >&2 || {
        echo "error: pip could not install torchtitan_ext and its dependencies (see above)" >&2
        exit 2
    }
    TTE_PYTHON="${_tte_venv}/bin/python"
fi
export PATH="$(dirname "${TTE_PYTHON}"):${PATH}"
unset _tte_root _tte_venv
