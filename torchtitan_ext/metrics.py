"""Step metrics: torchtitan's ``MetricsProcessor`` with step time on the console."""

import time
from typing import Any

from torchtitan.components.metrics import MetricsProcessor as TorchTitanMetricsProcessor
from torchtitan.tools.logging import logger


class MetricsProcessor(TorchTitanMetricsProcessor):
    """Logs every torchtitan metric; the console line adds the step time."""

    last_logged_step: int = 0

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        time_delta = time.perf_counter() - self.time_last_log
        steps_since_last_log = max(step - self.last_logged_step, 1)
        tps = self.ntokens_since_last_log / (
            time_delta * self.parallel_dims.non_data_parallel_size
        )
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        step_time = time_delta / steps_since_last_log
        memory = self.device_memory_monitor.get_peak_stats()
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
            "memory/max_active(GiB)": memory.max_active_gib,
            "memory/max_active(%)": memory.max_active_pct,
            "memory/max_reserved(GiB)": memory.max_reserved_gib,
            "memory/max_reserved(%)": memory.max_reserved_pct,
            "memory/num_alloc_retries": memory.num_alloc_retries,
            "memory/num_ooms": memory.num_ooms,
            **(extra_metrics or {}),
        }
        self.logger.log(metrics, step)

        color = self.color
        logger.info(
            f"{color.red}step: {step:2}  "
            f"{color.green}loss: {global_avg_loss:8.5f}  "
            f"{color.orange}grad_norm: {grad_norm:7.4f}  "
            f"{color.turquoise}memory: {memory.max_reserved_gib:5.2f}GiB"
            f"({memory.max_reserved_pct:.2f}%)  "
            f"{color.blue}tps: {round(tps):,}  "
            f"{color.yellow}step_time: {step_time:6.3f}s  "
            f"{color.cyan}tflops: {tflops:,.2f}  "
            f"{color.magenta}mfu: {mfu:.2f}%{color.reset}"
        )

        self.last_logged_step = step
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    """``TrainSpec.build_metrics_processor_fn`` for our train specs."""
    return MetricsProcessor(job_config, parallel_dims, tag)
