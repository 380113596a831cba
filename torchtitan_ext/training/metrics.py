"""Step metrics: torchtitan's ``MetricsProcessor`` plus step time, expert-parallel health and ``metrics.jsonl``.

Every logged step goes to torchtitan's loggers (console, TensorBoard, W&B) and, as one JSON object, to
``<dump_folder>/metrics.jsonl`` (:class:`MetricsFile`; :func:`~torchtitan_ext.records.metrics.read_metrics`
reads it back), which every tool reads instead of the console; every validation (``validation.enable``) to
``validation.jsonl`` beside it. The expert-parallel counters (``ep/...``, :class:`ExpertParallelMetrics`) live on
the device and are read once per logged step with one all-reduce (sum) and one all-reduce (max) over all ranks:
the hot path never syncs with the host. docs/metrics.md lists every metric and what it means.
"""

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import _get_metrics_rank, MetricsProcessor as TorchTitanMetricsProcessor
from torchtitan.tools.logging import logger

from torchtitan_ext.ep import backend_class
from torchtitan_ext.ep.budget import Budget
from torchtitan_ext.records.metrics import MetricsFile, VALIDATION_FILE

_LAYER = re.compile(r"layers\.(\d+)\.")


LOG_STEP_BUDGET = Budget(host_syncs=1, collectives=2)
"""What :class:`ExpertParallelMetrics` costs a logged step: a sum and a max all-reduce of the counters, one host
read of both (the training forwards only update them on the device)."""


class ExpertParallelMetrics:
    """Reads every MoE layer's dispatch counters at a log step and reduces them over all ranks."""

    def __init__(self, job_config, parallel_dims):
        # expert-TP ranks dispatch the same tokens; TP ranks that EP borrows dispatch a slice each
        self.dispatch_copies = parallel_dims.etp
        self.enabled = parallel_dims.ep_enabled
        self.remedy = backend_class(job_config).drop_remedy(job_config)
        self.warned = False

    @staticmethod
    def layer_stats(model_parts) -> dict[int, Any]:
        return {
            int(_LAYER.match(name).group(1)): module.dispatch_stats
            for part in model_parts
            for name, module in part.named_modules()
            if hasattr(module, "dispatch_stats") and _LAYER.match(name)
        }

    def collect(self, model_parts, step: int, step_time: float) -> tuple[dict[str, float], str]:
        """(metrics for the loggers, summary for the console line); empty without EP. ``step_time``: this rank's
        seconds per step since the last log, whose maximum over the ranks rides on the counters' all-reduce."""
        if not self.enabled:
            return {}, ""
        args = model_parts[0].model_args
        num_layers, num_experts = args.n_layers, args.moe_args.num_experts
        device = next(model_parts[0].parameters()).device
        if device.type == "meta":
            return {}, ""
        # per layer: routed pairs per expert, rows, kept pairs, ranks holding it, ranks counting kept pairs
        sums = torch.zeros(num_layers, num_experts + 4, dtype=torch.int64, device=device)
        # per layer: the busiest rank's rows; last, the slowest rank's step time in microseconds
        maxima = torch.zeros(num_layers + 1, dtype=torch.int64, device=device)
        maxima[num_layers] = round(step_time * 1e6)
        for layer, stats in self.layer_stats(model_parts).items():
            routed, rows, kept = stats.read_and_reset()
            if routed is not None:
                sums[layer, :num_experts] = routed
            if rows is not None:
                sums[layer, num_experts] = rows
                maxima[layer] = rows
            if kept is not None:
                sums[layer, num_experts + 1] = kept
                sums[layer, num_experts + 3] = 1
            sums[layer, num_experts + 2] = 1
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        values = torch.cat([sums.flatten(), maxima]).tolist()  # one host read of both
        *maxima, slowest_us = values[sums.numel():]
        sums = [values[layer * (num_experts + 4):(layer + 1) * (num_experts + 4)] for layer in range(num_layers)]
        metrics, console = self._summarize(sums, maxima, num_experts, step)
        metrics["time_metrics/end_to_end_slowest_rank(s)"] = slowest_us / 1e6
        return metrics, console

    def _summarize(self, sums, maxima, num_experts, step) -> tuple[dict[str, float], str]:
        metrics, total_dropped, total_routed = {}, 0, 0
        worst, worst_recv = (0.0, -1), 0.0
        busiest_rows, mean_rows = 0, 0.0
        for layer, row in enumerate(sums):
            holders, kept_counters = row[num_experts + 2], row[num_experts + 3]
            routed = [count / self.dispatch_copies for count in row[:num_experts]]
            if not holders or not sum(routed):
                continue
            pairs = sum(routed)
            if kept_counters not in (0, holders):
                raise RuntimeError(
                    f"MoE layer {layer}: {kept_counters} of the {holders} ranks holding it counted kept pairs; "
                    "every rank of a layer runs the same backend, so the drop count would be wrong"
                )
            dropped = pairs - row[num_experts + 1] / self.dispatch_copies if kept_counters else 0
            if dropped < 0:
                raise RuntimeError(
                    f"MoE layer {layer}: {-dropped:,.0f} more pairs kept than routed; a backend counts its kept pairs wrong"
                )
            imbalance = max(routed) / (pairs / num_experts)
            prefix = f"ep/layer_{layer}"
            metrics.update({
                f"{prefix}/dropped_pairs": dropped,
                f"{prefix}/drop_rate": dropped / pairs,
                f"{prefix}/load_imbalance": imbalance,
                f"{prefix}/recv_rows_max": maxima[layer],
                f"{prefix}/recv_rows_mean": row[num_experts] / holders,
            })
            total_dropped += dropped
            total_routed += pairs
            worst = max(worst, (imbalance, layer))
            if row[num_experts]:
                worst_recv = max(worst_recv, maxima[layer] / (row[num_experts] / holders))
                busiest_rows += maxima[layer]
                mean_rows += row[num_experts] / holders
            if dropped and not self.warned:
                self.warned = True
                logger.warning(
                    f"Expert parallelism dropped {dropped:,.0f} (token, expert) pairs "
                    f"({dropped / pairs:.3%} of the routed pairs) in MoE layer {layer} by step {step}: "
                    f"{self.remedy}. This warning is shown once; ep/drop_rate is logged every step."
                )
        if not total_routed:
            return {}, ""
        metrics.update({
            "ep/dropped_pairs": total_dropped,
            "ep/drop_rate": total_dropped / total_routed,
            "ep/load_imbalance_worst": worst[0],
            "ep/load_imbalance_worst_layer": worst[1],
            "ep/recv_rows_max_over_mean_worst": worst_recv,
        })
        console = f"recv max/mean: {worst_recv:.2f}"
        if mean_rows:
            metrics["ep/recv_rows_max_over_mean_all_layers"] = busiest_rows / mean_rows
        if total_dropped:
            console += f"  dropped: {total_dropped / total_routed:.2%}"
        return metrics, console


class MetricsProcessor(TorchTitanMetricsProcessor):
    """Logs every torchtitan metric; the console line adds step time and EP health; the metrics rank also writes
    them to ``metrics.jsonl`` (:class:`MetricsFile`)."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.expert_parallel = ExpertParallelMetrics(job_config, parallel_dims)
        self.steps_since_last_log = 0
        metrics_rank = _get_metrics_rank(parallel_dims, job_config) if dist.is_initialized() else 0
        writes = not dist.is_initialized() or dist.get_rank() == metrics_rank
        self.metrics_file = MetricsFile(Path(job_config.job.dump_folder)) if writes else None
        self.validation_file = MetricsFile(Path(job_config.job.dump_folder), VALIDATION_FILE) if writes else None
        self.sources: list[Callable[[], dict[str, float]]] = []
        """Features' own per-step metrics (expert replication's layers set aside), read at each log."""
        self._peaks_before_validation = None
        """The training window's peak memory before a validation reset the device's peaks (:meth:`validation_window`),
        until the next training log."""

    def should_log(self, step: int) -> bool:
        """torchtitan's rule; also counts the steps a log line covers (torchtitan's
        ``train_step`` asks once per step), which after a resume at step S is not S."""
        self.steps_since_last_log += 1
        return super().should_log(step)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        time_delta = time.perf_counter() - self.time_last_log
        steps_since_last_log = max(self.steps_since_last_log, 1)
        tps = self.ntokens_since_last_log / (
            time_delta * self.parallel_dims.non_data_parallel_size
        )
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        step_time = time_delta / steps_since_last_log
        memory = self.device_memory_monitor.get_peak_stats()
        if self._peaks_before_validation is not None:
            memory = type(memory)(*map(max, memory, self._peaks_before_validation))
            self._peaks_before_validation = None
        ep_metrics, ep_console = self.expert_parallel.collect(self.model_parts, step, step_time)
        metrics = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "mfu(%)": mfu,
            "time_metrics/end_to_end(s)": step_time,
            "time_metrics/data_loading(s)": sum(self.data_loading_times)
            / max(len(self.data_loading_times), 1),
            "time_metrics/data_loading(%)": 100 * sum(self.data_loading_times) / time_delta,
            **_peak_memory_metrics("memory/", memory),
            "memory/num_alloc_retries": memory.num_alloc_retries,
            "memory/num_ooms": memory.num_ooms,
            **ep_metrics,
            **{name: value for source in self.sources for name, value in source().items()},
            **(extra_metrics or {}),
        }
        self.logger.log(metrics, step)
        if self.metrics_file is not None:
            self.metrics_file.write(step, metrics)

        # under 120 columns with torchrun's prefix: memory, throughput, TFLOPS, MFU and expert-load
        # imbalance are logged every step to TensorBoard/W&B (and MFU is undefined on a CPU)
        color = self.color
        logger.info(
            f"{color.red}step: {step:2}  "
            f"{color.green}loss: {global_avg_loss:8.5f}  "
            f"{color.orange}grad_norm: {grad_norm:7.4f}  "
            f"{color.yellow}step_time: {step_time:6.3f}s{color.reset}"
            + (f"  {color.white}{ep_console}{color.reset}" if ep_console else "")
        )

        self.steps_since_last_log = 0
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()


    @contextmanager
    def validation_window(self) -> Iterator[None]:
        """A validation pass's own window of time, tokens and peak memory, which torchtitan's validator would count
        into the training steps' (its tokens) and its log would restart (their time and peaks): the pass logs its own
        figures, and the next training log's step time, throughput and peaks leave the pass out."""
        tokens, window_start, began = self.ntokens_since_last_log, self.time_last_log, time.perf_counter()
        peaks = self.device_memory_monitor.get_peak_stats()
        self.device_memory_monitor.reset_peak_stats()
        self.ntokens_since_last_log, self.time_last_log = 0, began
        try:
            yield
        finally:
            self.ntokens_since_last_log = tokens
            self.time_last_log = window_start + (time.perf_counter() - began)
            self.device_memory_monitor.reset_peak_stats()
            self._peaks_before_validation = peaks if self._peaks_before_validation is None else type(peaks)(
                *map(max, peaks, self._peaks_before_validation))

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        """torchtitan's validation metrics, also written to ``validation.jsonl``; within :meth:`validation_window`."""
        time_delta = time.perf_counter() - self.time_last_log
        memory = self.device_memory_monitor.get_peak_stats()
        metrics = {
            "validation_metrics/loss": loss,
            "validation_metrics/throughput(tps)": self.ntokens_since_last_log / (
                time_delta * self.parallel_dims.non_data_parallel_size),
            **_peak_memory_metrics("validation_metrics/memory/", memory),
            **(extra_metrics or {}),
        }
        self.logger.log(metrics, step)
        if self.validation_file is not None:
            self.validation_file.write(step, metrics)
        color = self.color
        logger.info(f"{color.yellow}validate step: {step:2}  {color.green}loss: {loss:8.5f}{color.reset}")


def _peak_memory_metrics(prefix: str, memory) -> dict[str, float]:
    """The device's peak memory as torchtitan names it, under ``prefix``."""
    return {
        f"{prefix}max_active(GiB)": memory.max_active_gib,
        f"{prefix}max_active(%)": memory.max_active_pct,
        f"{prefix}max_reserved(GiB)": memory.max_reserved_gib,
        f"{prefix}max_reserved(%)": memory.max_reserved_pct,
    }


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    """``TrainSpec.build_metrics_processor_fn`` for our train specs."""
    return MetricsProcessor(job_config, parallel_dims, tag)
