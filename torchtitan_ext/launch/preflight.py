"""Checks the launchers make before starting any process.

``python -m torchtitan_ext.launch.preflight --ngpu N [--nnodes M] [--port P] [--device-type cpu|cuda] [--print-env] [--print-launch-info] -- [train args]``
checks that torchrun takes the launchers' options, validates the process count, an
explicitly requested rendezvous port and the job config (TOML + overrides) for N x M ranks
(on ``--device-type``, default this machine's device), then, on a machine of the job's device type, what the
ranks would only find out once started (a dump folder they can write, the tokenizer in ``model.hf_assets_path``,
the checkpoint the job starts from, ``experimental.custom_import``, wandb where ``metrics.enable_wandb`` asks for
it, and on a CPU whether the weights, gradients and optimizer state fit in memory), and builds the embedded assets
the job needs. Any problem is one line on stderr naming it and the fix, with exit status 2, so that a bad launch
fails once, before torchrun starts N copies of it. ``--print-env`` prints ``export NAME=value`` lines for the environment
the EP backend's kernel library reads (e.g. HybridEP's NVLink-domain size), for
``eval`` in a launcher script; ``--print-launch-info`` what run_train.sh needs:
the rank whose log shows the loss (its default LOG_RANK) and the checkpoint
folder (for the supervisor's account of a failure).
"""

import argparse
import importlib.util
import logging
import os
import shlex
import socket
import sys

from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    import torch

    from torchtitan_ext import runtime
    from torchtitan.config import TORCH_DTYPE_MAP

    from torchtitan_ext.config import ConfigError, load_job_config, shared_meta_model
    from torchtitan_ext.config.validation import builds_torchtitans_optimizers
    from torchtitan_ext.runtime.memory import host_memory_bytes
    from torchtitan_ext.data import check_dataset_folder, check_tokenizer_folder, prepare_embedded_assets
    from torchtitan_ext.ep import backend_class
    from torchtitan_ext.runtime.console import init_logger
    from torchtitan_ext.training import prepare
    from torchtitan_ext.training.checkpoints import check_start_checkpoint


TORCHRUN_OPTIONS = ("--shutdown-timeout", "60")
"""An option the launchers pass to torchrun that an older one lacks (torch 2.11's has none): the seconds the ranks
get to save a checkpoint after a stop signal."""


def torchrun_parser() -> argparse.ArgumentParser:
    """The installed torchrun's own argument parser: the check asks it, not a version table."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def check_torchrun() -> None:
    """This torch's torchrun takes the launchers' options; an older one would stop at its own usage line."""
    _, unknown = torchrun_parser().parse_known_args([*TORCHRUN_OPTIONS, "train.py"])
    if unknown:
        raise ConfigError(
            f"torch {torch.__version__} is installed, and its torchrun has no {unknown[0]}, which this launcher "
            "passes (torch 2.12 and later have it): pip install torch==2.13.0 (the build for this machine)"
        )


def check_process_count(ngpu: str) -> int:
    try:
        count = int(ngpu)
    except ValueError:
        raise ConfigError(f"NGPU='{ngpu}' is not an integer: set NGPU to the process count, e.g. NGPU=2") from None
    limit = runtime.max_local_world_size()
    if count < 1:
        raise ConfigError(f"NGPU={count}: set NGPU to at least 1")
    if count > limit:
        where = (
            f"this machine has {limit} CUDA device(s)"
            if runtime.device_type() == "cuda"
            else f"this machine runs at most {limit} CPU processes (4 per core)"
        )
        raise ConfigError(f"NGPU={count} but {where}: set NGPU <= {limit}")
    return count


def check_log_ranks(text: str, local_processes: int) -> None:
    """LOG_RANK: comma-separated local ranks of this machine's processes (torchrun's --local-ranks-filter)."""
    ranks = text.split(",")
    bad = [rank for rank in ranks if not rank.strip().isdigit() or int(rank) >= local_processes]
    if bad:
        raise ConfigError(
            f"LOG_RANK='{text}': {bad[0]!r} is not a rank of the {local_processes} processes on this machine: "
            f"use ranks from 0 to {local_processes - 1}, comma separated, or unset LOG_RANK"
        )


def check_port_free(text: str) -> int:
    """The rendezvous port MASTER_PORT names, once it is a port number no process listens on."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError(
            f"MASTER_PORT='{text}' is not a port number: set it to an integer from 1 to 65535, "
            "or unset it to let torchrun pick a free port"
        )
    port = int(text)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # connections of an earlier run still in TIME_WAIT do not stop torchrun's store from binding
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("localhost", port))
        except OSError:
            raise ConfigError(
                f"rendezvous port {port} (MASTER_PORT) is in use: unset MASTER_PORT to let "
                "torchrun pick a free port, or set it to a free one"
            ) from None
    return port


def check_comm_mode(job_config) -> None:
    """ConfigError where the job asks torchtitan for a one-process mode (``comm.mode``): the launchers start the
    job's processes, each of which fails on it (local_tensor wants NGPU in its environment; a fake backend would
    train nothing)."""
    mode = job_config.comm.mode
    if mode != "default":
        raise ConfigError(f"comm.mode = '{mode}': the launcher starts the job's training processes, which need mode "
                          "'default'; for a one-process dry run over a fake process group, unset it and run "
                          "COMM_MODE=fake_backend NGPU=N ./run_train.sh")


def check_custom_import(job_config) -> None:
    """``experimental.custom_import`` names a module torchtitan's trainer imports in every rank as it starts: one
    this machine's Python cannot import fails each of them."""
    module = job_config.experimental.custom_import
    if not module:
        return
    try:
        found = importlib.util.find_spec(module) is not None  # a dotted name imports its parent packages
    except Exception as e:  # noqa: BLE001 - whatever a parent package raises, named in one line
        missing = getattr(e, "name", None) or ""  # ModuleNotFoundError's: a parent package that is not there
        if not isinstance(e, ModuleNotFoundError) or not (module == missing or module.startswith(f"{missing}.")):
            raise ConfigError(f"experimental.custom_import = '{module}' cannot be imported ({type(e).__name__}: "
                              f"{e}): fix that module, or unset it") from None
        found = False
    if not found:
        raise ConfigError(f"experimental.custom_import = '{module}' is not a module this machine's Python finds: "
                          "install it or add its folder to PYTHONPATH, or unset it")


def copies_per_parameter(job_config) -> int:
    """What a job holds of each parameter at least, in ``training.dtype``: the weight; its gradient, unless
    ``optimizer.early_step_in_backward`` steps and frees each as it arrives; the two moments of torchtitan's Adam
    or AdamW (made at the first step). A seed checkpoint's job holds the weights alone."""
    if job_config.checkpoint.create_seed_checkpoint:
        return 1
    gradients = 0 if job_config.optimizer.early_step_in_backward else 1
    moments = 2 if builds_torchtitans_optimizers(job_config) else 0
    return 1 + gradients + moments


def check_dump_folder(job_config) -> None:
    """``job.dump_folder``, where the job writes its metrics, checkpoints and traces, must be a folder this user can
    write, or one it can create: the ranks that write there failed on it with a traceback. Made here as they would."""
    folder = job_config.job.dump_folder
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"job.dump_folder = '{folder}' is a file: give a folder (the job writes its metrics, "
                          "checkpoints and traces in it)")
    try:
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as e:
        raise ConfigError(f"job.dump_folder = '{folder}' cannot be made a folder ({e.strerror}): give a folder this "
                          "user can write, or one it can create") from None
    if not writable:
        raise ConfigError(f"job.dump_folder = '{folder}' is not writable by this user: give a folder it can write")


def check_wandb(job_config) -> None:
    """``metrics.enable_wandb`` on a machine whose Python has no wandb (a stray ``./wandb`` folder, a namespace
    package with no module file, is none): torchtitan logs an error on its metrics rank and trains on without
    W&B. A login or network that ``wandb.init`` lacks is not checked: it fails the same way."""
    spec = importlib.util.find_spec("wandb") if job_config.metrics.enable_wandb else None
    if job_config.metrics.enable_wandb and (spec is None or spec.origin is None):
        raise ConfigError("metrics.enable_wandb is set, but this machine's Python has no wandb: pip install wandb, or "
                          "unset it (the step metrics go to metrics.jsonl either way)")


def check_cpu_memory(job_config, nodes: int) -> None:
    """A CPU job whose weights, gradients and optimizer state alone (:func:`copies_per_parameter` copies of each
    parameter in ``training.dtype``, torchtitan's parameter dtype), sharded over its ``nodes`` machines, exceed the
    memory and swap this machine gives the job (its control group's limits, where lower than the machine's): its
    ranks would be killed by the kernel's OOM killer once the model is built or at the first step, a SIGKILL each.
    A lower bound: the activations, the buffers and each process's own runtime come on top, so a job it passes may
    still not fit."""
    parameters = sum(p.numel() for p in shared_meta_model(job_config).parameters())
    copies = copies_per_parameter(job_config)
    needed = parameters * copies * TORCH_DTYPE_MAP[job_config.training.dtype].itemsize / nodes
    available = host_memory_bytes()
    if needed > available:
        per = f" per machine of {nodes}" if nodes > 1 else ""
        raise ConfigError(
            f"model.flavor = '{job_config.model.flavor}' has {parameters:,} parameters: {copies} cop"
            f"{'ies' if copies > 1 else 'y'} of each (the weights, the gradients and the optimizer's moments a step "
            f"holds) alone take {needed / 1e9:,.1f} GB{per} in {job_config.training.dtype}, more than the "
            f"{available / 1e9:,.1f} GB of memory and swap this machine gives the job: train a debug flavour here (as "
            "train_configs/*debug_model.toml do), or on GPUs"
        )


def main(argv: list[str] | None = None) -> None:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--ngpu", required=True, help="processes on this machine (NGPU)")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    parser.add_argument("--port", help="explicit rendezvous port to check (MASTER_PORT)")
    parser.add_argument("--log-rank", help="ranks whose output is shown (LOG_RANK), to check against the process count")
    parser.add_argument(
        "--device-type", choices=("cpu", "cuda"),
        help="validate the job for this device type (default: this machine's); for a batch script that "
        "checks a job on a host other than the ones that run it",
    )
    parser.add_argument("--print-env", action="store_true", help="print the kernel library's environment")
    parser.add_argument(
        "--print-launch-info", action="store_true",
        help="print export lines for the launcher: TTE_LOSS_RANK (the first rank that computes the loss, "
        "the default LOG_RANK), TTE_CHECKPOINT_FOLDER (empty when checkpointing is off) and TTE_DUMP_FOLDER",
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if (args.print_env or args.print_launch_info) and any(arg in ("-h", "--help") for arg in train_args):
        # a launcher evaluates what these print: the options' list would run as commands
        print("error: --help is among the job's config overrides: the launchers list their options with "
              "./run_train.sh --help; drop it from the launch", file=sys.stderr)
        sys.exit(2)
    init_logger(logging.WARNING, sys.stderr)
    try:
        check_torchrun()
        count = check_process_count(args.ngpu)
        if args.port is not None:
            check_port_free(args.port)
        if args.log_rank is not None:
            check_log_ranks(args.log_rank, count)
        device_type = prepare()
        job_config = load_job_config(train_args, args.device_type or device_type, world_size=count * args.nnodes)
        check_comm_mode(job_config)
        if args.device_type in (None, device_type):
            # this host trains, so its files and its memory are the ranks' (a batch host of another kind may not
            # see their files)
            check_tokenizer_folder(job_config)
            check_dataset_folder(job_config)
            check_start_checkpoint(job_config, count * args.nnodes)
            check_custom_import(job_config)
            check_wandb(job_config)
            if device_type == "cpu":
                check_cpu_memory(job_config, args.nnodes)
            check_dump_folder(job_config)  # last: it makes the folder, which a refused launch should not leave
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    prepare_embedded_assets(job_config)
    if args.print_env:
        for name, value in backend_class(job_config).library_environment(job_config).items():
            print(f"export {name}={shlex.quote(value)}")
    if args.print_launch_info:
        folder = os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder) if job_config.checkpoint.enable else ""
        print(f"export TTE_LOSS_RANK={loss_rank(job_config, count * args.nnodes)}")
        print(f"export TTE_CHECKPOINT_FOLDER={shlex.quote(folder)}")
        print(f"export TTE_DUMP_FOLDER={shlex.quote(job_config.job.dump_folder)}")


V_SCHEDULES = ("dualpipev", "zbvzerobubble")
"""Pipeline schedules whose stages fold back (a V): the last stage is on the first pipeline rank."""


def loss_rank(job_config, world_size: int) -> int:
    """The first rank that holds the last pipeline stage: with PP the other stages log a loss of -1."""
    parallelism = job_config.parallelism
    pp = parallelism.pipeline_parallel_degree
    if pp == 1 or parallelism.pipeline_parallel_schedule.lower() in V_SCHEDULES:
        return 0
    return world_size - world_size // pp


if __name__ == "__main__":
    run_and_exit(main)
