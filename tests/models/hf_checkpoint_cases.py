"""The per-rank worker of the HF checkpoint test: a model saved in Hugging Face names and safetensors by torchtitan's
state-dict adapter, loaded under our parallelize plan (EP over every rank, FSDP) the way torchtitan's checkpointer
loads ``checkpoint.initial_load_in_hf`` (CheckpointManager.dcp_load), then its logits gathered."""

import copy

import torch

from tests.models.gradient_cases import _forward, SEQ_LEN, tiny_model_args, VOCAB

SEED = 11


def load_hf_under_plan(rank: int, world_size: int, model_name: str, folder: str) -> dict:
    """{"reference": the saved model's logits (rank 0), "loaded": the loaded model's logits on this rank's batch}."""
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
    adapter = spec.state_dict_adapter(model_args, None)
    tokens = torch.randint(0, VOCAB, (world_size, SEQ_LEN), generator=torch.Generator().manual_seed(SEED))
    result = {}
    if rank == 0:
        torch.manual_seed(SEED)
        saved = spec.model_cls(model_args)
        with torch.no_grad():
            saved.init_weights()
            result["reference"] = _forward(saved, tokens).detach()
        hf_names = {name: tensor.contiguous() for name, tensor in adapter.to_hf(saved.state_dict()).items()}
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
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(folder))
    wrapper.load_state_dict(adapter.from_hf(hf_state))
    with torch.no_grad():
        result["loaded"] = _forward(model, tokens[rank:rank + 1]).detach()
    return result
