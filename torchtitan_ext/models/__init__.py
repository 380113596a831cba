"""DeepSeek-V3 and Llama4: torchtitan's models with our parallelize plans and model args.

Owns: one ``parallelize_<model>`` per model (:mod:`.deepseek_v3`,
:mod:`.llama4`) over the shared plan (:mod:`.parallelize`), each model's
flavours, the MoE layer that hands routing to the EP backend
(:mod:`.moe`), and the low-precision model converters (:mod:`.converters`). Their train specs (with training's loss and metrics) are
registered by :mod:`torchtitan_ext.training.specs`.

May import: :mod:`torchtitan_ext.config`, :mod:`torchtitan_ext.runtime`,
:mod:`torchtitan_ext.ep` (see the tiers in :mod:`torchtitan_ext`).
"""
