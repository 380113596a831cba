"""torchtitan_ext: a Mixture-of-Experts training harness on torchtitan 0.2.2 with pluggable
expert-parallel communication backends (NCCL all-to-all, DeepEP, HybridEP).

Tiers, lowest first: a module imports from its own part and from lower tiers only, never from a
higher tier or from another part of its own tier (tests/test_layering.py reads this list):

    1. config, metrics_file, preemption    job configs: sections, parsing, ranges, checks; the format of
                        metrics.jsonl; the preemption signals and a rank's flag for them
    2. runtime          device and process group, CPU accommodations, host memory, named collective failures
    3. ep, data         one ExpertParallel class per EP backend, its kernels; the embedded corpus
    4. models           DeepSeek-V3 and Llama4 parallelize plans and model args
    5. balancing        routing statistics, expert placement, moving experts while training
    6. training         the trainer, train specs, loss, metrics, fault handling
    7. planning         dry run, memory plan, topologies, cost model, layout advisor
    8. launch, bench    the launchers' pre-flight checks, the torchrun supervisor; benchmarks and checks
    9. train, plan, placement, supervise, routing_report, ledger    the command-line entry points

Each subpackage's docstring says what it owns. Features register their config sections and checks when
imported (:mod:`torchtitan_ext.config.registry`); ``torchtitan_ext.training.prepare`` readies a process.
"""
