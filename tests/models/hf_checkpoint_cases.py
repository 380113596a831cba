"""The per-rank worker of the HF checkpoint test: a model saved in Hugging Face names and safetensors by torchtitan's
state-dict adapter, loaded under our parallelize plan (EP over every rank, FSDP) the way torchtitan's checkpointer
loads ``checkpoint.initial_load_in_hf`` (CheckpointManager.dcp_load), then its logits gathered. GPT-OSS's experts
may be saved in MXFP4, as its published checkpoints store them (``checkpoint.initial_load_in_hf_quantized``)."""

import copy
import dataclasses

import torch

from tests.models.gradient_cases import _forward, SEQ_LEN, tiny_model_args, VOCAB

SEED = 11
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""An FP4 (E2M1) element by its 4-bit code: the OCP Microscaling spec's element type of MXFP4."""
MX_BLOCK = 32
"""Elements that share one scale in MXFP4."""


def mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, blocks, scales): random MXFP4 values of ``shape`` (its last dim a multiple of 32), and their encoding
    as GPT-OSS's checkpoints store it: blocks [..., last / 32, 16] uint8, two codes a byte, the even element's in the
    low nibble; scales [..., last / 32] uint8, each block's power-of-two exponent + 127."""
    *lead, last = shape
    codes = torch.randint(0, 16, (*lead, last // MX_BLOCK, MX_BLOCK), generator=generator)
    exponents = torch.randint(-8, -3, (*lead, last // MX_BLOCK), generator=generator)
    values = torch.tensor(E2M1)[codes] * torch.exp2(exponents.float()).unsqueeze(-1)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return values.reshape(shape), blocks, (exponents + 127).to(torch.uint8)


def load_hf_under_plan(rank: int, world_size: int, model_name: str, folder: str, quantized: bool = False) -> dict:
    """{"reference": the saved model's logits (rank 0), "loaded": the loaded model's logits on this rank's batch}.
    ``quantized`` (GPT-OSS): the experts' first weight (gate and up, [experts, 2 x hidden, dim]) saved in MXFP4
    (``_blocks`` and ``_scales``), as published checkpoints store both, and the second unquantized under its
    ``_blocks`` name, as torchtitan's HF export stores both: the quantized reader reads each. ``dim`` is raised to
    64, two MXFP4 blocks a row (a real checkpoint's rows hold dozens)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    from tests.helpers import REPO_ROOT
    from torchtitan_ext import runtime
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.training import prepare

    prepare()
    spec = get_train_spec(model_name)
    model_args = tiny_model_args(model_name, grouped_mm=False)
    if quantized:
        model_args = dataclasses.replace(model_args, dim=2 * MX_BLOCK)
    adapter = spec.state_dict_adapter(model_args, None)
    tokens = torch.randint(0, VOCAB, (world_size, SEQ_LEN), generator=torch.Generator().manual_seed(SEED))
    result = {}
    if rank == 0:
        torch.manual_seed(SEED)
        saved = spec.model_cls(model_args)
        encoded = {}
        with torch.no_grad():
            saved.init_weights()
            if quantized:
                generator = torch.Generator().manual_seed(SEED)
                for name, weight in saved.named_parameters():
                    if name.endswith("experts.mlp1_weight"):
                        values, *encoded[name] = mxfp4(tuple(weight.shape), generator)
                        weight.copy_(values)
            result["reference"] = _forward(saved, tokens).detach()
        hf_names = {name: tensor.contiguous() for name, tensor in adapter.to_hf(saved.state_dict()).items()}
        for name, (blocks, scales) in encoded.items():
            (hf_name,) = adapter.to_hf({name: None})
            hf_names[hf_name] = blocks
            hf_names[hf_name.removesuffix("_blocks") + "_scales"] = scales
        result["hf_names"] = sorted(hf_names)
        # written by torch's own HF writer, as torchtitan's checkpoint.last_save_in_hf writes
        dcp.save(hf_names, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=False), no_dist=True)
    dist.barrier()

    flavor = {"qwen3": "debugmodel_moe_small", "gpt_oss": "debugmodel_small"}[model_name]
    job_config = load_job_config(
        ["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"), "--model.name", model_name,
         "--model.flavor", flavor, "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "1",
         "--parallelism.expert_parallel_degree", str(world_size)], "cpu", world_size=world_size)
    parallel_dims = ParallelDims(dp_shard=world_size, dp_replicate=1, cp=1, tp=1, pp=1, ep=world_size, etp=1,
                                 world_size=world_size)
    parallel_dims.build_mesh()
    torch.manual_seed(SEED + 1)  # other weights, until the checkpoint's are loaded
    model = spec.model_cls(copy.deepcopy(model_args))
    with torch.no_grad():
        model.init_weights()
    model = spec.parallelize_fn(model, parallel_dims, job_config)
    runtime.adapt_model_parts([model])
    wrapper = ModelWrapper(model)
    hf_state = adapter.to_hf(wrapper.state_dict())
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(folder, from_quantized=quantized))
    wrapper.load_state_dict(adapter.from_hf(hf_state))
    with torch.no_grad():
        result["loaded"] = _forward(model, tokens[rank:rank + 1]).detach()
    return result
