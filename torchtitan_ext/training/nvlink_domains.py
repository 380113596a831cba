"""EP groups held to one NVLink domain: ``[fabric] ep_in_one_nvlink_domain``, checked by every rank at start.

A GB200 NVL72 rack is one multi-node NVLink domain; between racks traffic crosses RDMA, an order of magnitude
slower per GPU. A job whose EP groups are meant to be racks (the GB200 configs: EP = 64 = one rack's GPUs) runs
every MoE layer over RDMA if the scheduler spreads a group over two racks, with nothing failing. So each rank reads
its GPU's domain from NVML's GPU fabric info (the fabric's cluster UUID and the clique id: GPUs that share both
share one NVLink fabric); a GPU outside a multi-node fabric (an HGX node's GPUs, or a CPU rank) is in its host's
domain. The ranks exchange their domains once, before the model is built, and the job stops, in one line naming the
ranks, when an EP group spans more than one domain (so that the EP degree always divides the job's ranks in a
domain).
"""

import ctypes
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError, register_section


@dataclass
class Fabric:
    """``[fabric]``: where the job's ranks must sit on the NVLink fabric."""

    ep_in_one_nvlink_domain: bool = False
    """
    Whether every EP group must lie within one NVLink domain (an NVL72 rack; an HGX node; a CPU rank's host). At
    start the ranks read their GPUs' NVLink fabric identities (NVML) and the job stops, naming the ranks, if an EP
    group spans domains. The GB200 configs set it; leave
    it false where EP spans nodes by design (DeepEP internode kernels over RDMA).
    """


register_section("fabric", Fabric)


def nvlink_domain(device: torch.device) -> str:
    """The NVLink domain of the GPU ``device`` (NVML's fabric cluster UUID and clique id), or of this host where the
    GPU has no multi-node fabric or ``device`` is not a GPU."""
    host = f"host {socket.gethostname()}"
    if device.type != "cuda":
        return host
    try:
        import pynvml
    except ImportError:
        raise ConfigError("fabric.ep_in_one_nvlink_domain = true reads the GPUs' NVLink fabric through NVML: "
                          "pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise ConfigError(f"fabric.ep_in_one_nvlink_domain = true reads the GPUs' NVLink fabric, but NVML does not "
                          f"start on {host} ({e}): check the driver, or set it to false") from None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        info.version = pynvml.nvmlGpuFabricInfo_v2
        try:
            # by reference: pynvml hands the argument to the C function as it is
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except pynvml.NVMLError_NotSupported:
            return host
        except pynvml.NVMLError as e:
            raise ConfigError(f"NVML could not read the NVLink fabric of {host}'s GPU {device.index} ({e}): update "
                              "the driver, or set fabric.ep_in_one_nvlink_domain = false") from None
        cluster = bytes(info.clusterUuid)
        if info.state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED or not any(cluster):
            return host
        if info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED or info.status != pynvml.NVML_SUCCESS:
            raise ConfigError(
                f"the NVLink fabric of {host}'s GPU {device.index} is not ready (NVML fabric state {info.state}, "
                f"status {info.status}): check the node's IMEX and fabric manager services, or set "
                "fabric.ep_in_one_nvlink_domain = false"
            )
        return f"fabric {cluster.hex()} clique {info.cliqueId}"
    finally:
        pynvml.nvmlShutdown()


def _ranks(ranks: list[int]) -> str:
    """Ranks as ranges: "0-31, 40"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


def ep_domain_problem(domains: list[str], ep_groups: list[list[int]]) -> str | None:
    """Why the EP groups ``ep_groups`` (global ranks) do not each lie within one domain of ``domains`` (one per global
    rank); None when they do. (EP groups partition the ranks, so groups within domains also divide each domain's
    ranks in the job by the EP degree.)"""
    for group in ep_groups:
        spanned: dict[str, list[int]] = {}
        for rank in group:
            spanned.setdefault(domains[rank], []).append(rank)
        if len(spanned) > 1:
            where = "; ".join(f"ranks {_ranks(ranks)} on {domain}" for domain, ranks in spanned.items())
            return f"the EP group of ranks {_ranks(group)} spans {len(spanned)} NVLink domains ({where})"
    return None


def check_ep_domains(job_config, parallel_dims, device: torch.device) -> None:
    """Every rank: exchange NVLink domains and stop the job, in one line, if the EP groups do not each lie within one
    (``[fabric] ep_in_one_nvlink_domain``); one collective, before the model is built."""
    if not job_config.fabric.ep_in_one_nvlink_domain or not parallel_dims.ep_enabled:
        return
    ep_ranks = tuple(dist.get_process_group_ranks(parallel_dims.get_mesh("ep").get_group()))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (nvlink_domain(device), ep_ranks))
    domains = [domain for domain, _ in gathered]
    problem = ep_domain_problem(domains, sorted({ranks for _, ranks in gathered}))
    if problem:
        raise ConfigError(
            f"fabric.ep_in_one_nvlink_domain = true: {problem}: launch on whole NVLink domains (GB200: "
            "multinode_trainer.slurm's --segment, docs/gb200_nvl72.md), or set it to false to run EP across domains"
        )
    logger.info(f"NVLink domains: every EP group of {len(ep_ranks)} ranks within one of {len(set(domains))}")
