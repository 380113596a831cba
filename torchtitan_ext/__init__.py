"""torchtitan_ext: a Mixture-of-Experts training harness on torchtitan 0.2.2 with pluggable
expert-parallel communication backends (NCCL all-to-all, DeepEP, HybridEP).

Each subpackage's docstring says what it owns. Tiers, lowest first: a module
imports from its own part and from lower tiers only, never from a higher tier
or from another part of its own tier (tests/test_layering.py checks this list):

    1. config           job configs: our sections, parsing, ranges, checks, load_job_config
    2. runtime          device and process group, CPU accommodations, host memory, named collective failures
    3. ep, data         one ExpertParallel class per EP backend, its kernels; the embedded corpus
    4. models           DeepSeek-V3 and Llama4 parallelize plans and model args
    5. balancing        routing statistics, expert placement, moving experts while training
    6. training         the trainer, train specs, loss, metrics, fault handling
    7. planning         dry run, memory plan, topologies, cost model, layout advisor
    8. launch           the launchers' pre-flight checks, the torchrun supervisor
    9. train, plan, placement, supervise, routing_report    the command-line entry points

A feature owns its config section and registers it, with its checks, when it
is imported (:mod:`torchtitan_ext.config.registry`): config never imports a
feature. ``torchtitan_ext.training.prepare`` readies a process to read and run jobs.
"""
