"""EP groups held to one NVLink domain: the check on fake fabric tables, and the NVML reading behind it."""

import ctypes
import sys
import types

import pytest
import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.training.nvlink_domains import ep_domain_problem, nvlink_domain

RACK_A, RACK_B = "fabric 0a clique 1", "fabric 0b clique 1"


def test_ep_groups_each_within_one_rack_pass():
    # 128 ranks on two racks in rank order, EP = 64: each group one rack
    assert ep_domain_problem([RACK_A] * 64 + [RACK_B] * 64, [list(range(64)), list(range(64, 128))]) is None


def test_an_ep_group_split_over_two_racks_is_named_with_its_ranks():
    # the scheduler gave the job 16 trays of one rack and 16 of another, interleaved in rendezvous order
    domains = [RACK_A] * 32 + [RACK_B] * 32 + [RACK_A] * 32 + [RACK_B] * 32
    problem = ep_domain_problem(domains, [list(range(64)), list(range(64, 128))])
    assert problem == (f"the EP group of ranks 0-63 spans 2 NVLink domains (ranks 0-31 on {RACK_A}; ranks 32-63 on "
                       f"{RACK_B})")


class _FakeNVML(types.ModuleType):
    """pynvml with one GPU whose fabric reports ``state`` (and ``cluster``, ``clique``), or no fabric at all; like
    the real one, it writes the answer through the pointer it is given."""

    NVML_SUCCESS = 0
    nvmlGpuFabricInfo_v2 = 0x2000024
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, NVML_GPU_FABRIC_STATE_NOT_STARTED = 0, 1
    NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_GPU_FABRIC_STATE_COMPLETED = 2, 3

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, state: int | None, cluster: bytes = bytes(range(16)), clique: int = 7):
        super().__init__("pynvml")
        self.state, self.cluster, self.clique = state, cluster, clique

        class Info(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_uint),
                        ("cliqueId", ctypes.c_uint), ("state", ctypes.c_uint), ("healthMask", ctypes.c_uint)]

        self.c_nvmlGpuFabricInfoV_t = Info

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert uuid == "GPU-fake-uuid"
        return "handle"

    def nvmlDeviceGetGpuFabricInfoV(self, handle, pointer):
        info = ctypes.cast(pointer, ctypes.POINTER(self.c_nvmlGpuFabricInfoV_t)).contents
        assert info.version == self.nvmlGpuFabricInfo_v2
        if self.state is None:
            raise self.NVMLError_NotSupported()
        info.clusterUuid[:] = list(self.cluster)
        info.cliqueId, info.state, info.status = self.clique, self.state, 0


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="fake-uuid"))
    monkeypatch.setattr("socket.gethostname", lambda: "tray3")

    def with_nvml(fake):
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return nvlink_domain(torch.device("cuda", 0))

    return with_nvml


def test_a_gpu_on_a_multi_node_fabric_is_in_its_cluster_and_clique(one_gpu):
    assert one_gpu(_FakeNVML(_FakeNVML.NVML_GPU_FABRIC_STATE_COMPLETED)) == \
        "fabric 000102030405060708090a0b0c0d0e0f clique 7"


def test_a_gpu_without_a_fabric_is_in_its_hosts_domain(one_gpu):
    assert one_gpu(_FakeNVML(None)) == "host tray3"
    assert one_gpu(_FakeNVML(_FakeNVML.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)) == "host tray3"
    assert one_gpu(_FakeNVML(_FakeNVML.NVML_GPU_FABRIC_STATE_COMPLETED, cluster=bytes(16))) == "host tray3"


def test_a_fabric_not_ready_is_refused_in_one_line(one_gpu):
    with pytest.raises(ConfigError, match=r"^the NVLink fabric of host tray3's GPU 0 is not ready \(NVML fabric state "
                                          r"2, status 0\): check the node's IMEX and fabric manager services"):
        one_gpu(_FakeNVML(_FakeNVML.NVML_GPU_FABRIC_STATE_IN_PROGRESS))
