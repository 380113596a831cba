"""Train a job: ``python -m torchtitan_ext.train [--job.config_file X] [overrides]`` (under torchrun).

A bad config is one line on stderr (from local rank 0) and exit status 2,
before any process group exists; the run itself is :func:`torchtitan_ext.training.trainer.run`.
"""

import os
import signal
import sys

from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    from torchtitan_ext.config import ConfigError, load_job_config
    from torchtitan_ext.data import prepare_embedded_assets
    from torchtitan_ext.launch.processes import die_with_parent
    from torchtitan_ext.runtime.console import init_logger
    from torchtitan_ext.training import prepare
    from torchtitan_ext.training.trainer import run


def main(args: list[str] | None = None) -> None:
    # a rank whose torchrun is gone (killed, even by SIGKILL) stops as on preemption instead of running on
    die_with_parent(signal.SIGTERM, os.getppid())
    init_logger()
    device_type = prepare()
    try:
        job_config = load_job_config(sys.argv[1:] if args is None else args, device_type)
        if job_config.checkpoint.create_seed_checkpoint and int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint needs a single process: run with NGPU=1")
    except ConfigError as e:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    prepare_embedded_assets(job_config)
    sys.exit(run(job_config))


if __name__ == "__main__":
    run_and_exit(main)
