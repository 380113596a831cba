"""torchtitan_ext: a Mixture-of-Experts training harness on torchtitan 0.2.2 with pluggable
expert-parallel communication backends (NCCL all-to-all, DeepEP, HybridEP, NCCL EP).

Tiers, lowest first: a module imports from its own part and from lower tiers only, never from a
higher tier or from another part of its own tier (tests/test_layering.py reads this list):

    1. config           job configs: sections, parsing, ranges, checks
    2. runtime, records    device and process group, CPU accommodations, host memory, named collective
                        failures, the job launcher, preemption signals; the files one tool writes and another
                        reads (metrics.jsonl, the EP benchmark's rows)
    3. ep, data         one ExpertParallel class per EP backend, its kernels, expert replication; the embedded corpus
    4. models           DeepSeek-V3, Llama4, Qwen3-MoE and GPT-OSS parallelize plans and model args,
                        low-precision converters
    5. balancing, planning    routing statistics, expert placement, moving experts while training; pricing a job
                        before launch: memory, topologies, cost model, layout advisor
    6. training         the trainer, train specs, loss, metrics, fault handling
    7. measuring        what runs the real code to measure it: the dry run, the device-cost ledger, measured
                        compute, the benchmarks' timing
    8. launch, bench    the launchers' pre-flight checks, the torchrun supervisor; benchmarks and checks
    9. train, plan, placement, supervise, routing_report, ledger    the command-line entry points

Each subpackage's docstring says what it owns. Features register their config sections and checks when
imported (:mod:`torchtitan_ext.config.registry`); ``torchtitan_ext.training.prepare`` readies a process.
"""
