"""EP planner: memory and drop risk of each backend for a job, and which backend and EP layout to use.

    python -m torchtitan_ext.plan --job.config_file X [overrides] [--world-size N] [--routing-stats DUMP]
        [--topology T [--ranks-per-group N] [--measure-compute] [--replica-slots 0,1,2] [--calibrate-from FILE ...]
         [--json FILE] [--emit-config FILE]]
    python -m torchtitan_ext.plan --paper --topology T --world-size G --paper-data-mb D --paper-expert-mb P_E
        --paper-pre-expert-ms PE
    python -m torchtitan_ext.plan --calibrate [--nproc N] [--calibrate-output FILE]
    python -m torchtitan_ext.plan --validate [--comparisons FILE] [--fit-from FILE] [--error-output FILE]
    python -m torchtitan_ext.plan --fit [--comparisons FILE] [--fit-output FILE]

The first prints the memory plan (:mod:`torchtitan_ext.planning.memory_plan`), and with ``--topology`` the
layout advisor's ranked table (:mod:`torchtitan_ext.planning.layout_advisor`); ``--paper`` evaluates the
seed paper's one-level setting; ``--calibrate`` measures this machine and writes its topology
(:mod:`torchtitan_ext.planning.calibrate`); ``--validate`` prices the published comparisons of EP backends
(:mod:`torchtitan_ext.planning.published_comparisons`) and ``--fit`` fits the advisor's free parameters on
them (:mod:`torchtitan_ext.planning.advisor_fit`). See docs/planning.md.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    import torch.distributed as dist

    from torchtitan_ext.balancing.routing_stats import check_fits, load_path
    from torchtitan_ext.config import (
        ConfigError, job_world_size, load_job_config, model_args_of, moe_layer_ids, moe_shape, parse, register_hf_model,
        with_config_file,
    )
    from torchtitan_ext.config.parsing import command_line_keys
    from torchtitan_ext.config.writing import write_job_config
    from torchtitan_ext.measuring.compute import check_measurable, measure_compute
    from torchtitan_ext.measuring.dry_run import dry_run
    from torchtitan_ext.planning.advice_report import advice_record, format_advice, format_paper
    from torchtitan_ext.planning.advisor_error import (
        AS_SHIPPED, load_error, measured_error, pricing_name, SHIPPED as SHIPPED_ERROR, write_error,
    )
    from torchtitan_ext.planning.advisor_fit import fit, format_fit, load_fit, SHIPPED as SHIPPED_FIT, write_fit
    from torchtitan_ext.planning.calibrate import calibrate
    from torchtitan_ext.planning.layout_advisor import advise, advised_config, overrides_problem
    from torchtitan_ext.planning.measured_rates import calibration_rates
    from torchtitan_ext.planning.memory_plan import format_plan, plan
    from torchtitan_ext.planning.paper_model import PaperSetting
    from torchtitan_ext.planning.published_comparisons import (
        format_validation, load_comparisons, SHIPPED as SHIPPED_COMPARISONS, validate,
    )
    from torchtitan_ext.planning.topology import load_topology
    from torchtitan_ext.training import prepare


def main(argv: list[str] | None = None) -> None:
    args, train_args = _parser().parse_known_args(argv)
    _exit_on_error(_check_flags, args)
    if args.hf_config is not None:
        hf_overrides = _exit_on_error(register_hf_model, args.hf_config)
        if args.emit_config is not None:
            _exit_on_error(_check_emitted_tokenizer, with_config_file(train_args), hf_overrides, args.emit_config)
        train_args = [*train_args, *hf_overrides]
    if args.calibrate:
        _exit_on_error(_check_process_count, args.nproc)
        calibrate(args.nproc, args.calibrate_output)
    elif args.paper:
        print("\n".join(_exit_on_error(_paper, args)))
    elif args.validate:
        prepare()
        fit_from = args.fit_from or SHIPPED_FIT
        fitted = _exit_on_error(load_fit, fit_from)
        comparisons, shipped, under_fit = _exit_on_error(validate, args.comparisons, fitted)
        print("\n".join(format_validation(comparisons, shipped, under_fit, _shown(fit_from))))
        if args.error_output is not None:
            errors = [_exit_on_error(measured_error, AS_SHIPPED, comparisons, shipped),
                      _exit_on_error(measured_error, pricing_name(fit_from), comparisons, under_fit)]
            command = "python -m torchtitan_ext.plan " + " ".join(argv if argv is not None else sys.argv[1:])
            _exit_on_error(write_error, errors, args.error_output, command)
            print(f"Wrote the advisor's error ({', '.join(e.pricing for e in errors)}) to {args.error_output}")
    elif args.fit:
        prepare()
        fitted = _exit_on_error(fit, _exit_on_error(load_comparisons, args.comparisons))
        _exit_on_error(write_fit, fitted, args.fit_output, args.comparisons)
        print("\n".join(format_fit(fitted)))
        print(f"Wrote {fitted.count} parameters to {args.fit_output}")
    else:
        # the job run_train.sh would run: its config file, else CONFIG_FILE, else the default job
        _plan_job(args, _exit_on_error(with_config_file, train_args), " ".join(argv if argv is not None else sys.argv[1:]))


def _parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: NGPU, else the config's degrees)")
    parser.add_argument("--routing-stats", type=Path,
                        help="routing_stats folder or .npz file: the expected drop rate, and with --topology the measured token bytes")
    parser.add_argument("--topology", help="topology TOML (a path, or a name in topologies/): add the layout advice")
    parser.add_argument("--ranks-per-group", type=int, metavar="N",
                        help="with --topology: ranks the job places in each group of the topology's innermost level "
                             "(default: all its workers; a 256-GPU job on NVL72 racks of 72 places 64 per rack)")
    parser.add_argument(
        "--measure-compute", action="store_true",
        help="with --topology: time the job's per-rank compute and each backend's local dispatch work on this "
             "machine (one process per rank) instead of FLOPs",
    )
    parser.add_argument(
        "--replica-slots", type=_slot_counts, metavar="S[,S...]",
        help="with --topology: price every layout at each of these expert_replication.slots_per_rank values "
             "(default: the job's own); with --routing-stats, from the busiest rank's rows after the split",
    )
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="with --topology: also write every layout considered (backend, ep_degree, runnable, "
                             "step_s, ...) to FILE as JSON")
    parser.add_argument("--calibrate-from", type=Path, metavar="FILE", action="append",
                        help="with --topology (repeatable): price each backend's all-to-all at the rate measured on "
                             "your cluster, on the link the measurement spanned, in place of the published figures: "
                             "FILE is python -m torchtitan_ext.bench ep --json output (one machine: the innermost "
                             "link), the log of nccl-tests' alltoall_perf (the nccl backend, on as many nodes as it "
                             "ran), or the log of DeepEP's or HybridEP's own test script at the job's hidden size and "
                             "tokens per rank (its NVLink or RDMA link)")
    parser.add_argument("--emit-config", type=Path, metavar="FILE",
                        help="with --topology: write the recommended layout's job config (every field, the other "
                             "backends' sections at their defaults) to FILE as TOML, checked by loading it back")
    parser.add_argument("--paper", action="store_true", help="evaluate the seed paper's one-level setting (needs --topology)")
    parser.add_argument("--paper-data-mb", type=float, help="--paper: D, MB of tokens one worker dispatches")
    parser.add_argument("--paper-expert-mb", type=float, help="--paper: P_E, MB of one worker's experts")
    parser.add_argument("--paper-pre-expert-ms", type=float, help="--paper: Lat^PE, pre-expert compute in ms")
    parser.add_argument("--validate", action="store_true",
                        help="price every published comparison the advisor can price and report predicted against "
                             "published (docs/published_comparisons.toml)")
    parser.add_argument("--fit", action="store_true",
                        help="fit the advisor's free parameters on the comparisons whose role is fit, and write them "
                             "to --fit-output")
    parser.add_argument("--comparisons", type=Path, default=SHIPPED_COMPARISONS, metavar="FILE",
                        help="--validate, --fit: the comparisons file (default docs/published_comparisons.toml)")
    parser.add_argument("--fit-output", type=Path, default=SHIPPED_FIT, metavar="FILE",
                        help="--fit: where to write the parameters (default docs/advisor_fit.toml)")
    parser.add_argument("--fit-from", type=Path, metavar="FILE",
                        help="with --topology: price the layouts under the parameters plan --fit wrote (the compute "
                             "scale, and the fitted link rates where no published figure exists; a --calibrate-from "
                             "rate wins over a fitted one); --validate: predict under them beside the advisor as "
                             "shipped (default docs/advisor_fit.toml)")
    parser.add_argument("--error-output", type=Path, metavar="FILE",
                        help="--validate: also write the advisor's error on the held-out comparisons, as shipped and "
                             "under the fit, to FILE (docs/advisor_error.toml ships)")
    parser.add_argument("--error-from", type=Path, metavar="FILE",
                        help="with --topology: the advisor's measured error that sets the decision's band and the "
                             "TFLOPS ranges (default docs/advisor_error.toml)")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine and write its topology")
    parser.add_argument("--nproc", type=int, default=2, help="--calibrate: gloo processes (default 2)")
    parser.add_argument(
        "--hf-config", type=Path, default=None, metavar="FILE",
        help="with --topology: plan the model of this Hugging Face config.json (model_type deepseek_v3, gpt_oss, "
             "qwen3_moe, mixtral or llama4) in place of the job config's model; the job config gives the rest (batch, "
             "parallelism, precision); --emit-config names it as model.flavor 'hf:FILE', which training reads",
    )
    parser.add_argument(
        "--calibrate-output", type=Path, default=Path("outputs/this_machine_topology.toml"),
        help="--calibrate: where to write the topology (default outputs/this_machine_topology.toml)",
    )
    return parser


def _plan_job(args, train_args: list[str], command: str) -> None:
    """The memory plan and, with --topology, the layout advice; what --json and --emit-config write."""
    prepare()
    try:
        world_size, topology, rates, fitted_fractions = _priced_topology(args, train_args)
        # the advisor's error under this pricing, measured on the held-out published comparisons
        error = None if topology is None else load_error(
            args.error_from or SHIPPED_ERROR, pricing_name(args.fit_from))
        job_config = load_job_config(train_args, device_type=None, world_size=world_size)
        if args.measure_compute:
            check_measurable(job_config, world_size)
            load_job_config(train_args, device_type="cpu", world_size=world_size)  # what a CPU job refuses
        stats = None
        if args.routing_stats is not None:
            stats = load_path(args.routing_stats)
            shape = moe_shape(job_config)
            if shape is not None:
                check_fits(stats, moe_layer_ids(job_config), shape.num_experts, f"--routing-stats {args.routing_stats}")
        result = plan(job_config, dry_run(job_config, world_size), stats)
        compute = measure_compute(train_args, world_size) if args.measure_compute else None
        advice, routing = (None, None) if topology is None else advise(
            train_args, world_size, topology, stats, str(args.routing_stats), compute, args.replica_slots, progress=True,
            measured_rates=rates, fitted_fractions=fitted_fractions,
        )
        problem = overrides_problem(train_args, world_size, advice[0]) if advice and advice[0].refused is None else None
        if args.emit_config is not None:
            if advice[0].refused is not None:
                raise ConfigError(f"--emit-config {args.emit_config}: no layout of this job runs on {world_size} ranks, "
                                  f"nothing to write; {advice[0].backend} at EP={advice[0].ep}: {advice[0].refused}")
            layout = advice[0]
            write_job_config(
                advised_config(train_args, world_size, layout), args.emit_config, world_size,
                f"Written by python -m torchtitan_ext.plan {command}\n"
                f"the recommended layout on topology '{topology.name}': {layout.label} at EP={layout.ep}, "
                f"efsdp={layout.efsdp}, {layout.replica_slots} replica slot(s) per rank; every field of the job's config",
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print("\n".join(format_plan(result, world_size)))
    model = result.dry_run.model
    if advice is not None:
        print("\n".join(format_advice(advice, topology, world_size, model, problem, routing, compute, error=error)))
    if args.json is not None:
        written = args.json.with_name(f".{args.json.name}.partial")
        try:
            written.write_text(json.dumps(advice_record(advice, error), indent=1) + "\n", encoding="utf-8")
            os.replace(written, args.json)
        except OSError as e:
            written.unlink(missing_ok=True)
            print(f"error: --json {args.json}: could not write it ({e.strerror}): free space or choose another path",
                  file=sys.stderr)
            sys.exit(2)
        print(f"Wrote {len(advice)} layouts to {args.json}")
    if args.emit_config is not None:
        print(f"Wrote the recommended layout's job config to {args.emit_config} "
              f"(train with: ./run_train.sh --job.config_file {args.emit_config})")


def _priced_topology(args, train_args: list[str]):
    """(the job's world size, the topology with its ranks placed, the measured or fitted rates, the shipped fit's
    link shares): what the advice prices layouts on, the last three None without --topology. The topology and
    fit files are read before the job config, so that a bad file is named first."""
    topology = load_topology(args.topology) if args.topology else None
    fitted_rates, fitted_fractions = {}, None
    if args.fit_from is None and topology is not None and SHIPPED_FIT.exists():
        # a layout priced at a nominal rate is a range: from that bound to the rate the shipped fit gives
        fitted_fractions = load_fit(SHIPPED_FIT).link_shares()
    if args.fit_from is not None:
        fitted = load_fit(args.fit_from)
        topology, fitted_rates = fitted.applied(topology)
        if topology.name not in fitted.compute_scale and not fitted_rates:
            raise ConfigError(f"--fit-from {args.fit_from}: it fits nothing of topology '{topology.name}' (its "
                              f"compute scales: {', '.join(fitted.compute_scale) or 'none'}): fit on a "
                              "comparison run on it, or drop --fit-from")
    job_config = parse(train_args)
    world_size = job_world_size(job_config, args.world_size)
    placed = topology if topology is None else topology.placed_for(world_size, args.ranks_per_group)
    # bench_ep's processes fill the machines it ran on: its rows are placed before the job's ranks per group
    rates = None if args.calibrate_from is None else calibration_rates(args.calibrate_from, topology, placed,
                                                                       moe_shape(job_config))
    rates = {**fitted_rates, **(rates or {})} or None  # a rate measured on the cluster wins over a fitted one
    if rates and args.measure_compute and any(rate.includes_local_work for rate in rates.values()):
        raise ConfigError("--calibrate-from's bench_ep rates hold each backend's local work, which "
                          "--measure-compute adds again: drop one of them")
    if placed is not None:
        placed.group_sizes(world_size)
    return world_size, placed, rates, fitted_fractions


def _shown(path: Path) -> str:
    """``path`` as the user would type it here: relative to the working folder when it lies inside it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def _check_flags(args) -> None:
    """Every flag that needs another, or excludes one, refused in one line before anything is read or measured."""
    other_modes = args.calibrate or args.paper or args.validate or args.fit
    for flag, value in (("--json", args.json), ("--emit-config", args.emit_config)):
        if value is not None and other_modes:
            raise ConfigError(f"{flag} writes from the layout advice, which --calibrate, --paper, --validate and "
                              "--fit do not give: drop one of them")
    if args.validate and args.fit:
        raise ConfigError("--validate and --fit: run --fit first (it writes the parameters), then --validate")
    if args.error_output is not None and not args.validate:
        raise ConfigError("--error-output writes the error --validate measures: add --validate")
    if args.hf_config is not None:
        # the layout advice prices the model by its FLOPs and bytes: its compute is not measured here
        for flag, given in (("--topology", args.topology is not None), ("no --measure-compute", not args.measure_compute)):
            if not given:
                raise ConfigError(f"--hf-config prices a model by its FLOPs and bytes in the layout advice: use it "
                                  f"with {flag}")
    for flag, path in (("--json", args.json), ("--emit-config", args.emit_config), ("--error-output", args.error_output)):
        if path is not None and (path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK)):
            raise ConfigError(f"{flag} {path}: not a file in a writable folder: give a path in an existing folder you "
                              "can write")
    if args.topology is not None or other_modes:
        return
    for flag, given, what in (
        ("--fit-from", args.fit_from is not None, "prices the layout advice under fitted parameters"),
        ("--calibrate-from", args.calibrate_from is not None, "prices the layout advice's layouts"),
        ("--ranks-per-group", args.ranks_per_group is not None, "places ranks in the topology's groups"),
        ("--measure-compute", args.measure_compute, "sets the layout advice's compute"),
        ("--replica-slots", args.replica_slots is not None, "prices the layout advice's layouts"),
        ("--error-from", args.error_from is not None, "sets the layout advice's decision"),
        ("--json", args.json is not None, "writes from the layout advice"),
        ("--emit-config", args.emit_config is not None, "writes from the layout advice"),
    ):
        if given:
            raise ConfigError(f"{flag} {what}: add --topology")


def _slot_counts(text: str) -> list[int]:
    """``--replica-slots``: comma-separated integers >= 0."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [-1]
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"'{text}': use comma-separated slot counts >= 0, e.g. 0,1,2")
    return counts


def _check_emitted_tokenizer(job_args: list[str], hf_overrides: list[str], emit_config: Path) -> None:
    """The emitted config keeps the job config's tokenizer (``model.hf_assets_path``): refused where the job's own
    model has another vocabulary than the --hf-config model's (its token ids would overrun the embedding, or mean
    other tokens), unless the command line names the tokenizer."""
    if "model.hf_assets_path" in command_line_keys(job_args):
        return
    job = parse(job_args)
    theirs = model_args_of(job).vocab_size
    ours = model_args_of(parse([*job_args, *hf_overrides])).vocab_size
    if ours != theirs:
        raise ConfigError(
            f"--emit-config {emit_config}: the job config's tokenizer, model.hf_assets_path = "
            f"'{job.model.hf_assets_path}', is that of {job.model.name} flavour '{job.model.flavor}' ({theirs:,} tokens), "
            f"not the --hf-config model's ({ours:,}): set --model.hf_assets_path to that model's folder, or give a job config "
            "of the same model"
        )


def _exit_on_error(fn, *args):
    try:
        return fn(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _check_process_count(nproc: int) -> None:
    if nproc < 2:
        raise ConfigError(f"--nproc {nproc}: an all-to-all needs at least 2 processes")


def _paper(args) -> list[str]:
    missing = [
        flag for flag, value in (
            ("--topology", args.topology), ("--world-size", args.world_size), ("--paper-data-mb", args.paper_data_mb),
            ("--paper-expert-mb", args.paper_expert_mb), ("--paper-pre-expert-ms", args.paper_pre_expert_ms),
        ) if value is None
    ]
    if missing:
        raise ConfigError(f"--paper needs {', '.join(missing)}")
    for flag, value in (("--world-size", args.world_size), ("--paper-data-mb", args.paper_data_mb),
                        ("--paper-expert-mb", args.paper_expert_mb)):
        if not 0 < value < math.inf:
            raise ConfigError(f"{flag} {value}: use a finite value > 0")
    if not 0 <= args.paper_pre_expert_ms < math.inf:
        raise ConfigError(f"--paper-pre-expert-ms {args.paper_pre_expert_ms}: use a finite time >= 0")
    topology = load_topology(args.topology)
    # the one link G workers span: the innermost level whose group holds them all
    link = topology.levels[topology.rank_levels(args.world_size)[-1]]
    setting = PaperSetting(
        args.world_size, args.paper_data_mb * 1e6, args.paper_expert_mb * 1e6, link.bandwidth_GBps * 1e9,
        args.paper_pre_expert_ms * 1e-3,
    )
    return format_paper(setting, f"'{link.name}' of {topology.name}")


if __name__ == "__main__":
    run_and_exit(main)
