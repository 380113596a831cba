"""The layout advice as text and JSON: the ranked table, the recommendation and its reasons, the layouts that
cannot run, the seed paper's one-level setting."""

import textwrap

from torchtitan_ext.ep import PLANNING_PROFILES
from torchtitan_ext.planning.advice_decision import decide, Decision, measure_arguments
from torchtitan_ext.planning.advisor_error import ModelError
from torchtitan_ext.planning.cost_model import MeasuredRouting
from torchtitan_ext.planning.layout import Layout
from torchtitan_ext.planning.measured_compute import MeasuredCompute
from torchtitan_ext.planning.paper_model import (
    eq3_a2a_volume, eq4_ag_volume, optimal_p, p_of_domain_size, pair_counts, PaperSetting,
)
from torchtitan_ext.planning.topology import Topology


def _ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _tflops(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


WIDTH = 118
"""The advice's lines stay within this many columns."""


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns, the first at ``indent``, the rest two further in."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False)


def _command(prefix: str, arguments: list[str]) -> list[str]:
    """``prefix`` and the (flag, value) pairs of ``arguments``, continued with backslashes past :data:`WIDTH`."""
    pairs = [" ".join(arguments[i:i + 2]) for i in range(0, len(arguments), 2)]
    lines, current = [], prefix + pairs[0]
    for pair in pairs[1:]:
        if len(current) + len(pair) + 3 > WIDTH:
            lines.append(current + " \\")
            current = " " * len(prefix) + pair
        else:
            current += " " + pair
    return [*lines, current]


def _evidence(layout: Layout, topology: Topology, routing: MeasuredRouting | None,
              measured_compute: MeasuredCompute | None) -> str:
    """What the recommended layout's price rests on: its all-to-all rates, the compute, the routing."""
    rates = f"its all-to-all rates: {', '.join(layout.rate_evidence)}" if layout.rate_evidence else "no all-to-all (EP=1)"
    if measured_compute is not None:
        compute = "compute measured on this machine (--measure-compute)"
    elif topology.compute_source:
        compute = f"compute at {topology.compute_source}"
    else:
        compute = "compute at the topology's stated rate (not fitted)"
    traffic = f"routing measured ({routing.source})" if routing is not None else "uniform routing"
    return f"{rates}; {compute}; {traffic}{_overlap(layout)}"


def _overlap(layout: Layout) -> str:
    """The all-to-alls' overlap with another microbatch, and the SMs priced against the GEMMs beside them."""
    if not layout.a2a_overlap:
        return ""
    sms = (f"its kernels hold {layout.communication_sm_share:.0%} of the SMs, priced against the GEMMs beside them"
           if not layout.sm_note else f"the SMs its kernels take are not priced ({layout.sm_note})")
    return f"; all-to-alls beside another microbatch's compute ({_ms(layout.exposed_s)} ms of MoE communication exposed per step), {sms}"


def _reason(best: Layout, others: list[Layout]) -> str:
    """Why ``best`` wins: against the best layout of another backend, and the best layout at another EP degree."""
    layouts = (best, *others)
    # (what the ranking adds up, its short name in a breakdown, its value): the terms some layout has
    terms = [
        (name, short, value) for name, short, value in (
            ("the backend's local work", "local work", lambda layout: layout.local_work_s),
            ("the busiest rank's expert compute above the mean", "busiest-rank compute", lambda layout: layout.imbalance_s),
            ("the replicas' traffic", "replica traffic", lambda layout: layout.replica_s),
        ) if any(value(layout) for layout in layouts)
    ]

    def moe_time(layout: Layout) -> str:
        if not terms:
            return f"{_ms(layout.exposed_s)} ms"
        added = " + ".join(f"{_ms(value(layout))} {short}" for _, short, value in terms)
        return f"{_ms(layout.moe_s)} ms: {_ms(layout.exposed_s)} exposed communication + {added}"

    if terms:
        names = " plus ".join(name for name, _, _ in terms)
        parts = [f"least exposed MoE communication plus {names} per step, {moe_time(best)}"]
    else:
        parts = [f"least exposed MoE communication, {_ms(best.exposed_s)} ms per step"]
    rival = next((o for o in others if o.backend != best.backend), None)
    copies = "" if rival is None else (
        f"{best.label} sends {best.costs.token_copies:.2f} copies of each token per dispatch, "
        f"{rival.label} {rival.costs.token_copies:.2f}"
    )
    if best.link_bound:
        parts.insert(0, f"the least predicted step, set by its busiest link ({best.busiest_link[0]} carries "
                        f"{_ms(best.busiest_link[1])} ms per step)")
    if rival is not None and rival.step_s == best.step_s:
        parts.append(
            f"{rival.label} at EP={rival.ep} ties (the same predicted step: the model does not separate them, and "
            f"keeps the job's own backend first)"
        )
    elif rival is not None and terms:
        parts.append(f"{rival.label} (best at EP={rival.ep}) takes {moe_time(rival)} ({copies})")
    elif rival is not None:
        parts.append(f"{rival.label} (best at EP={rival.ep}) exposes {_ms(rival.exposed_s)} ms: {copies}")
    without = next((o for o in others if (o.label, o.ep, o.replica_slots) == (best.label, best.ep, 0)), None)
    if best.replica_slots and without is not None:
        parts.append(
            f"with {best.replica_slots} replica slot(s) the busiest rank computes {best.rows_ratio:.3f}x the mean rank's "
            f"expert rows ({without.rows_ratio:.3f}x without), {_ms(best.imbalance_s)} ms above the mean per step "
            f"({_ms(without.imbalance_s)} without), for {_ms(best.replica_s)} ms of replica traffic"
        )
    elif best.rows_ratio > 1:
        parts.append(
            f"the busiest rank computes {best.rows_ratio:.3f}x the mean rank's expert rows, "
            f"{_ms(best.imbalance_s)} ms above the mean per step"
        )
    neighbour = next((o for o in others if o.ep != best.ep), None)
    if neighbour is not None:
        def describe(layout: Layout) -> str:
            a2a = f"all-to-all {_ms(layout.costs.a2a)} ms" + (f" over {layout.a2a_level}" if layout.a2a_level else "")
            exposed_gather = layout.costs.exposed(layout.overlap) - layout.costs.all_to_alls(False) * layout.costs.a2a
            gather = f"expert gather/scatter {_ms(exposed_gather)} ms exposed" + (
                f" over {layout.gather_level}" if layout.gather_level else ""
            )
            return f"{a2a}, {gather}"

        parts.append(
            f"per layer, EP={best.ep} has {describe(best)}; the best other EP degree, {neighbour.label} at "
            f"EP={neighbour.ep} ({moe_time(neighbour)}), has {describe(neighbour)}"
        )
    return "; ".join(parts)


def format_advice(
    layouts: list[Layout], topology: Topology, world_size: int, model: str, overrides_problem: str | None,
    routing: MeasuredRouting | None = None, measured_compute: MeasuredCompute | None = None, *, error: ModelError,
) -> list[str]:
    """The advice as lines of at most :data:`WIDTH` columns, its decision taken with the advisor's measured
    ``error`` (:func:`~torchtitan_ext.planning.advice_decision.decide`)."""
    runnable = [layout for layout in layouts if layout.refused is None]
    decision = decide(runnable, error) if runnable else None
    lines = [
        f"Layout advice: {model} on {world_size} ranks, topology '{topology.name}' "
        f"(communication {'overlaps' if topology.overlap else 'does not overlap'} compute)",
    ]
    if routing is not None:
        lines.append(
            f"  token bytes and rank loads from measured routing ({routing.source}: {routing.dispatches} step x layer "
            "dispatches), the busiest receiving rank's share, experts in logical order"
        )
    else:
        lines.append("  token bytes assume uniform routing (--routing-stats DUMP uses a run's measured routing)")
    priced_slots = sorted({layout.replica_slots for layout in layouts})
    prices_replicas = any(priced_slots)
    if prices_replicas and routing is None:
        lines.append(
            "  replica slots priced under uniform routing, where every rank computes the mean: they only add "
            "their traffic (--routing-stats DUMP prices the imbalance they remove)"
        )
    elif prices_replicas:
        lines.append(
            f"  replica slots {', '.join(map(str, priced_slots))} priced by replaying the dump's counts through "
            "training's choice and split of replicas, from the steps after the first choice (every slot count on "
            "the same dispatches)"
        )
    if prices_replicas:
        expert_time = ("measured on this machine (--measure-compute)" if measured_compute is not None
                       else f"their FLOPs at {topology.compute_tflops:g} TFLOP/s")
        lines += _wrapped(
            f"replicas' inputs: the busiest rank's expert time from {expert_time}, taken as proportional to the rows "
            "it computes; their weights, gradients and the counts' all-gather at the nominal rate of the EP group's "
            "outermost link; not priced: the host's choice of replicas between steps (python -m torchtitan_ext.bench "
            "replication_cpu_time measures it, and the expert time per row, on a CPU)", "  ")
    if runnable:
        first = runnable[0]
        if measured_compute is None:
            compute = f"at {topology.compute_tflops:g} TFLOP/s"
            if first.mxfp8_flop_share:
                rate = (f"{topology.mxfp8_compute_tflops:g} TFLOP/s" if topology.mxfp8_compute_tflops
                        else "the same rate (the topology gives no mxfp8_compute_tflops)")
                compute += f", its {first.mxfp8_flop_share:.0%} in MXFP8 GEMMs at {rate}"
        else:
            compute = (
                f"measured on this machine ({measured_compute.processes} processes: forward + backward "
                f"{measured_compute.forward_backward_s:.3f} s, the routed experts {measured_compute.routed_experts_s:.3f} "
                f"s of it; optimizer {measured_compute.optimizer_s:.3f} s for all parameters)"
            )
        pipelined = (f" on the busiest pipeline rank, stretched {first.pipeline_bubble:.1%} by the schedule's bubble"
                     if first.pipeline_bubble else "")
        lines.append(
            f"  {first.moe_layers} MoE layers{pipelined} ({first.recomputed_layers} recomputed by activation checkpointing), "
            f"{first.dispatches} MoE call(s) per layer and step; compute {_ms(first.compute_s)} ms per step "
            f"{compute}; data-parallel sync {_ms(first.data_parallel_s)} ms per step "
            f"({_ms(first.data_parallel_exposed_s)} exposed); "
            "times per rank"
        )
        lines.append("  all-to-all at the fraction of each link's nominal rate its kernels reach, as published "
                     "(docs/published_ep_figures.md) or measured (--calibrate-from):")
        for rates in dict.fromkeys(layout.kernel_rates for layout in runnable):
            lines += _wrapped(rates, "    ")
        shows_local = any(layout.dispatch_work_s for layout in runnable)
        counted = {("torchtitan's own sort (EP=1)" if layout.ep == 1 else layout.label): layout.local_traffic
                   for layout in runnable if layout.local_traffic is not None}
        if counted:
            held = sorted({layout.label for layout in runnable if layout.ep > 1 and layout.local_traffic is None})
            growing = sorted({
                layout.label for layout in runnable if layout.received_tokens != 1.0 and layout.local_traffic
                and (layout.local_traffic.forward_token_bytes or layout.local_traffic.backward_token_bytes)
            })
            lines += _wrapped(
                "local: each backend's passes over the token rows outside its kernels, counted at the job's shape "
                "in a group of one (docs/planning.md), per MoE call forward and backward: "
                + ", ".join(f"{label} {traffic.bytes / 1e9:.1f} GB" for label, traffic in counted.items())
                + (f"; {', '.join(growing)} hold a received token vector for each EP rank a token reaches"
                   if growing else "")
                + (f"; not counted for {', '.join(held)}: the rate measured on the cluster (--calibrate-from, "
                   "bench_ep) holds it" if held else "")
                + f"; at the {topology.memory_bandwidth_GBps:,.0f} GB/s memory bandwidth, eager mode", "  ")
        links = {name: f"L{index}" for index, name in enumerate(dict.fromkeys(
            layout.a2a_level for layout in runnable if layout.a2a_level), start=1)}
        lines.append(
            f"  {'#':>3} {'backend':<14} {'EP':>4} {'efsdp':>5} {'slots ' if prices_replicas else ''}{'copy':>5} "
            f"{'A2A ms':>6} {'AG ms':>6} {'exposed':>7} {'local ' if shows_local else ''}"
            f"{'rows x ' if routing is not None else ''}{' repl ' if prices_replicas else ''}"
            f"{'step ms':>7} {'TFLOPS':>6} {'mem GB':>5} {'link%':>5} over"
        )
        for index, layout in enumerate(runnable, start=1):
            c = layout.costs
            lines.append(
                f"  {index:>3} {layout.label:<14} {layout.ep:>4} {layout.efsdp:>5} "
                f"{f'{layout.replica_slots:>5} ' if prices_replicas else ''}{c.token_copies:>5.2f} "
                f"{_ms(c.a2a):>6} {_ms(c.all_gather):>6} {_ms(layout.exposed_s):>7} "
                f"{f'{_ms(layout.local_work_s):>5} ' if shows_local else ''}"
                f"{f'{layout.rows_ratio:>6.3f} ' if routing is not None else ''}"
                f"{f'{_ms(layout.replica_s):>5} ' if prices_replicas else ''}{_ms(layout.step_s):>7} "
                f"{_tflops(layout.tflops_per_gpu):>6} {layout.memory_bytes / 1e9:>5.3g} "
                f"{layout.busiest_link[1] / layout.step_s:>5.0%} {links.get(layout.a2a_level, '-')}"
            )
        lines += _wrapped(
            "columns: copy: copies of each token that leave the rank per dispatch; A2A ms and AG ms per layer and call; exposed, local, repl (the replicas' traffic) and step ms per step; rows x: the "
            "busiest rank's expert rows over the mean rank's; TFLOPS: model TFLOP/s per GPU at the predicted step; "
            "mem GB: what a rank needs at least; link%: the busiest link's traffic per step (hidden or not) over the "
            "step (100%: the link sets the step); over: the outermost link the all-to-all crosses, "
            + ", ".join(f"{short} = {name}" for name, short in links.items())
            + "".join(f"; {legend}" for legend in dict.fromkeys(
                PLANNING_PROFILES[layout.backend].settings_legend for layout in runnable if layout.settings) if legend), "  ")
        with_slots = f", {first.replica_slots} replica slot(s) per rank" if prices_replicas else ""
        low, high = decision.tflops_range(first)
        lines.append(
            f"  {'recommended' if decision.kind == 'pick' else 'first by the model'}: {first.label} at EP={first.ep}, "
            f"efsdp={first.efsdp}{with_slots}: {_ms(first.step_s)} ms per step predicted, {_tflops(low)} to "
            f"{_tflops(high)} TFLOPS/GPU ({_tflops(first.tflops_per_gpu)} as priced)"
        )
        lines += _wrapped(f"evidence: {_evidence(first, topology, routing, measured_compute)}", "    ")
        if first.nominal_links:
            lines += _wrapped(
                f"priced at the nominal rate of {' and '.join(first.nominal_links)} (no published figure), a bound it "
                f"may not reach{_fitted(first)}, as every runnable layout here is: time it, and give --calibrate-from "
                "the measurement (python -m torchtitan_ext.bench ep --json, or an nccl-tests alltoall_perf log)", "    ")
        # compared with the layouts priced as it is (a nominal rate's bound is no price)
        alike = [layout for layout in runnable[1:] if bool(layout.nominal_links) == bool(first.nominal_links)]
        lines += _wrapped(f"why: {_reason(first, alike)}", "    ")
        link, busy = first.busiest_link
        if busy:
            lines += _wrapped(
                f"busiest link: {link} carries {_ms(busy)} ms per step ({busy / first.step_s:.0%} of the step"
                + ("; it sets the step: its traffic cannot all hide)" if first.link_bound else ")"), "    ")
        lines += _decision_lines(decision, prices_replicas)
        lines += _command("  overrides: ", first.overrides())
        if overrides_problem is not None:
            lines += _wrapped(f"with those, this job config still fails its checks: {overrides_problem}", "  ")
    as_configured = {(layout.backend, layout.ep, layout.replica_slots): layout.refused
                     for layout in layouts if layout.refused is not None and not layout.settings}
    # an alternative refused for the reason its backend as configured is, is listed once
    refused = [layout for layout in layouts if layout.refused is not None and not (
        layout.settings and as_configured.get((layout.backend, layout.ep, layout.replica_slots)) == layout.refused)]
    if refused:
        lines.append("  not runnable (the job's config checks; other backends' sections at their defaults):")
        # one line per backend and reason: a limit that no EP degree meets is said once, with the degrees it refused
        degrees: dict[tuple[str, int, str], list[int]] = {}
        for layout in refused:
            degrees.setdefault((layout.label, layout.replica_slots, layout.refused), []).append(layout.ep)
        for (label, slots, reason), eps in degrees.items():
            lines += _wrapped(
                f"{label}{f' slots={slots}' if prices_replicas else ''} EP={', '.join(map(str, eps))}: {reason}", "    ")
    return [wrapped for line in lines for wrapped in (_wrapped(line.lstrip(), line[:len(line) - len(line.lstrip())])
                                                      if len(line) > WIDTH else [line])]


def _decision_lines(decision: Decision, prices_replicas: bool) -> list[str]:
    """The decision: one layout, or the layouts to time on the cluster, each with what to add to the job's launch;
    and where the band and the TFLOPS ranges come from."""
    error = decision.error
    source = (f"the largest error of a predicted gap between two backends on {len(error.rows)} held-out "
              f"comparisons, priced {error.pricing} ({error.file}); TFLOPS ranges: the predicted figure "
              f"over {error.figure_ratio_low:.2f}x to {error.figure_ratio_high:.2f}x, the predicted / published "
              "figures measured there")
    if decision.kind == "pick":
        return _wrapped(f"decision: pick. Every other layout predicts a step more than {error.gap_band:.1%} longer: "
                        f"the band is {source}", "  ")
    lines = _wrapped(
        f"decision: measure. {len(decision.candidates)} layouts predict steps within {error.gap_band:.1%} of the "
        f"first's, which the model cannot tell apart (the band is {source}). Time each on your cluster: launch the "
        "job as you do with each line's arguments added, and compare the median "
        "time_metrics/end_to_end_slowest_rank(s) in each run's metrics.jsonl after its first 3 steps:", "  ")
    # each backend setting's best candidate; the others are in --json
    best = {}
    for layout in decision.candidates:
        best.setdefault(layout.label, layout)
    shown = list(best.values())
    for index, layout in enumerate(shown, start=1):
        low, high = decision.tflops_range(layout)
        bound = (f", a bound at {' and '.join(layout.nominal_links)}'s nominal rate (no published figure)"
                 f"{_fitted(layout)}" if layout.nominal_links else "")
        slots = f" {layout.replica_slots} slots" if prices_replicas else ""
        lines += _wrapped(f"{index}. {layout.label} EP={layout.ep}{slots}: {_ms(layout.step_s)} ms{bound}, "
                          f"{_tflops(low)} to {_tflops(high)} TFLOPS/GPU", "    ")
        lines += _command("       ", measure_arguments(layout))
    if len(shown) < len(decision.candidates):
        lines += _wrapped(f"and {len(decision.candidates) - len(shown)} more layout(s) of these backends within the "
                          "band (--json FILE lists every candidate)", "    ")
    return lines


def _fitted(layout: Layout) -> str:
    """", 9,130 ms at the fitted rate": the other end of a nominal rate's range, where a fit covers it."""
    return "" if layout.fitted_step_s is None else f", {_ms(layout.fitted_step_s)} ms at the fitted rate"


def advice_record(layouts: list[Layout], error: ModelError) -> dict:
    """The advice as a JSON-ready object: the decision, its band and where the band comes from, the candidates
    (rank among the layouts, the TFLOPS range, what to add to the job's launch to time it), and every layout."""
    runnable = [layout for layout in layouts if layout.refused is None]
    decision = decide(runnable, error) if runnable else None
    if decision is None:
        return {"decision": None, "band": None, "error": None, "candidates": [], "layouts": layouts_record(layouts)}
    error = decision.error
    return {
        "decision": decision.kind,
        "band": error.gap_band,
        "error": {"pricing": error.pricing, "gap_band": error.gap_band, "figure_ratio_low": error.figure_ratio_low,
                  "figure_ratio_high": error.figure_ratio_high, "held_out_rows": list(error.rows)},
        "candidates": [
            {"rank": layouts.index(layout) + 1, "backend": layout.backend, "ep_degree": layout.ep,
             "replica_slots": layout.replica_slots, "step_s": layout.step_s, "tflops_per_gpu": layout.tflops_per_gpu,
             "tflops_per_gpu_range": list(decision.tflops_range(layout)), "bound": bool(layout.nominal_links),
             "overrides": layout.overrides(), "measure_with": measure_arguments(layout)}
            for layout in decision.candidates],
        "layouts": layouts_record(layouts),
    }


def layouts_record(layouts: list[Layout]) -> list[dict]:
    """Every layout considered, ranked ones first, as JSON-ready objects (times in seconds per step and rank)."""
    records = []
    for rank, layout in enumerate(layouts, start=1):
        record = {
            "backend": layout.backend, "ep_degree": layout.ep, "efsdp_degree": layout.efsdp,
            # every setting of the backend's section that differs from the job's
            "settings": {f"{section}.{field}": value
                         for section, field, value in (*layout.ep_settings, *layout.settings)},
            "replica_slots": layout.replica_slots, "runnable": layout.refused is None, "refused": layout.refused,
        }
        if layout.refused is None:
            record.update(
                rank=rank, step_s=layout.step_s, moe_s=layout.moe_s, compute_s=layout.compute_s,
                exposed_communication_s=layout.exposed_s, communication_s=layout.communication_s,
                local_work_s=layout.local_work_s, busiest_rank_compute_s=layout.imbalance_s,
                replica_traffic_s=layout.replica_s, data_parallel_exposed_s=layout.data_parallel_exposed_s,
                token_copies=layout.costs.token_copies, all_to_all_s=layout.costs.a2a, rows_max_over_mean=layout.rows_ratio,
                all_to_all_over=layout.a2a_level, gathered_expert_bytes=layout.gathered_expert_bytes,
                buffer_bytes=layout.buffer_bytes, overrides=layout.overrides(), kernel_rates=layout.kernel_rates,
                rate_evidence=list(layout.rate_evidence), tflops_per_gpu=layout.tflops_per_gpu, memory_bytes=layout.memory_bytes,
                nominal_links=list(layout.nominal_links), link_busy_s=dict(layout.link_busy),
                pricing="range" if layout.nominal_links else "priced",
                step_s_range=[layout.step_s, layout.fitted_step_s] if layout.nominal_links else None,
                assumption=(f"all-to-all over {' and '.join(layout.nominal_links)} at the link's nominal rate (no "
                            "published figure): a lower bound of its time; "
                            + ("the range's other end at the share of it a fit gives (docs/advisor_fit.toml)"
                               if layout.fitted_step_s is not None else "no fit covers it: the range has no other end")
                            if layout.nominal_links else None),
                link_bound=layout.link_bound, all_to_all_overlap=layout.a2a_overlap,
                communication_sm_share=layout.communication_sm_share if layout.a2a_overlap and not layout.sm_note else None,
                sm_not_priced=layout.sm_note or None,
            )
        records.append(record)
    return records


def format_paper(setting: PaperSetting, link: str) -> list[str]:
    """The seed paper's one-level setting at every feasible expert-domain size, in its notation."""
    G, D, P_E, B = setting.G, setting.D, setting.P_E, setting.B
    case = "2.2: 2D >= G P_E, all-gather only" if 2 * D >= G * P_E else "2.1: 2D < G P_E, both transfers"
    lines = [
        f"Paper setting (one worker per entry, bandwidth only): G={G}, D={D / 1e6:g} MB, P_E={P_E / 1e6:g} MB, "
        f"B={B / 1e9:g} GB/s ({link}), Lat^PE={setting.pre_expert * 1e3:g} ms",
        f"  {'S':>4} {'p':>6} {'A2A pairs':>9} {'AG pairs':>8} {'Lat^A2A ms':>10} {'Lat^AG ms':>9} {'Lat ms':>9}",
    ]
    for S in setting.domain_sizes():
        pairs = pair_counts([G], [S])
        lines.append(
            f"  {S:>4} {p_of_domain_size(G, S):>6.3f} {pairs['A2A']:>9} {pairs['AG']:>8} "
            f"{_ms(eq3_a2a_volume(D, G // S) / B):>10} {_ms(eq4_ag_volume(P_E, S) / B):>9} {_ms(setting.latency(S)):>9}"
        )
    best = setting.best_domain_size()
    p_star = optimal_p(G, D, P_E, B, setting.pre_expert)
    lines.append(
        f"  best feasible: S={best} (p={p_of_domain_size(G, best):.3f}, {_ms(setting.latency(best))} ms); "
        f"closed form (case {case}): p*={p_star:.3f}"
    )
    return lines
