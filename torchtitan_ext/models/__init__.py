"""DeepSeek-V3, Llama4, Qwen3 (Qwen3-MoE) and GPT-OSS: torchtitan's models with our parallelize plans and model args.

Owns: one ``parallelize_<model>`` per model (:mod:`.deepseek_v3`,
:mod:`.llama4`, :mod:`.qwen3`, :mod:`.gpt_oss`) over the shared plan (:mod:`.parallelize`), each model's
args converted from torchtitan's (:mod:`.args`),
flavours, the MoE layer that hands routing to the EP backend
(:mod:`.moe`), and the low-precision model converters (:mod:`.converters`). Their train specs (with training's loss and metrics) are
registered by :mod:`torchtitan_ext.training.specs`.

May import: :mod:`torchtitan_ext.config`, :mod:`torchtitan_ext.runtime`,
:mod:`torchtitan_ext.ep` (see the tiers in :mod:`torchtitan_ext`).
"""
