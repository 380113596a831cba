"""torchtitan's Hugging Face state-dict adapters keep working under our parallelize plan: a tiny Qwen3-MoE and
GPT-OSS, saved in HF names and safetensors by the adapter, load into the model with EP over 2 ranks and FSDP (each
rank's experts a shard of the HF checkpoint's per-expert or stacked tensors) and give the saved model's logits;
GPT-OSS's too with its experts in MXFP4, as its published checkpoints hold them, read by the adapter's quantized
reader (``checkpoint.initial_load_in_hf_quantized``)."""

import pytest
import torch

from tests.helpers import run_distributed
from tests.models.hf_checkpoint_cases import load_hf_under_plan

pytestmark = pytest.mark.slow

HF_NAMES = {
    # one routed-expert tensor each family's HF checkpoint holds, in its own layout
    "qwen3": "model.layers.0.mlp.experts.7.down_proj.weight",
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj_bias",
}


@pytest.mark.parametrize("model_name, quantized", [("qwen3", False), ("gpt_oss", False), ("gpt_oss", True)])
def test_hf_checkpoint_loads_under_expert_parallelism(model_name, quantized, tmp_path):
    ranks = run_distributed(2, load_hf_under_plan, model_name, str(tmp_path), quantized, deadline_s=300)
    assert HF_NAMES[model_name] in ranks[0]["hf_names"]
    reference = ranks[0]["reference"]
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["loaded"], reference[rank:rank + 1], rtol=1e-5, atol=1e-6)
