"""Contract: the layout advisor prices the GEMMs a job's MXFP8 converters quantize at the topology's MXFP8 rate, as
torchtitan 0.2.2 picks them; a published comparison's precision sets those converters."""

import pytest

from torchtitan_ext.config import load_job_config, meta_model
from torchtitan_ext.planning.job_shape import job_shape
from torchtitan_ext.planning.published_comparisons import job_of, load_comparisons, MXFP8_CONVERTERS
from torchtitan_ext.training import prepare

DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]

prepare()  # as the advisor's process: every section (the GB200 configs' [fabric]) and our train specs


def _shape(*converters: str):
    job = load_job_config(DEBUG_JOB, device_type=None, world_size=2)
    job.model.converters = list(converters)
    job.quantize.grouped_mm.mx.fqns = ["experts"]
    return job_shape(job, 2)


def test_each_mxfp8_converter_adds_its_gemms_flops():
    job = load_job_config(DEBUG_JOB, device_type=None, world_size=2)
    model = meta_model(job)
    _, per_token = model.model_args.get_nparams_and_flops(model, job.training.seq_len)
    moe = model.model_args.moe_args
    parameters = dict(model.named_parameters())
    routed = sum(p.numel() for name, p in parameters.items() if ".moe.experts." in name) * moe.top_k / moe.num_experts
    # linear.mx: every 2-D weight with dims multiples of 16 (not the router's 8 experts) but the embeddings and the
    # output layer (its default filter_fqns)
    linear = sum(p.numel() for name, p in parameters.items()
                 if p.ndim == 2 and not p.shape[0] % 16 and not p.shape[1] % 16
                 and not name.startswith(("tok_embeddings.", "output.")))
    bf16, experts, both = _shape(), _shape("quantize.grouped_mm.mx"), _shape(*MXFP8_CONVERTERS)
    assert (bf16.mxfp8_flop_share, bf16.experts_in_mxfp8) == (0.0, False)
    assert experts.experts_in_mxfp8
    assert experts.mxfp8_flop_share == pytest.approx(6 * routed / per_token)
    assert both.mxfp8_flop_share == pytest.approx(6 * (routed + linear) / per_token)


def test_a_comparisons_precision_sets_its_jobs_mxfp8_converters():
    rows = {row.id: row for row in load_comparisons() if row.priced}
    # both rows price the 671B GB200 config, whose own converter is quantize.grouped_mm.mx
    bf16 = job_of(rows["mbridge-3561-gpt-oss-120b-gb200-ep64-bf16"])
    mxfp8 = job_of(rows["mbridge-3561-gpt-oss-120b-gb200-ep64-mxfp8"])
    assert [c for c in bf16.model.converters if c in MXFP8_CONVERTERS] == []
    assert sorted(c for c in mxfp8.model.converters if c in MXFP8_CONVERTERS) == sorted(MXFP8_CONVERTERS)
