"""What only tests and benchmarks use, kept out of every process a user runs: no product module
imports this package (``tests/test_architecture.py`` checks it). It plugs into the product's
seams: a rank actor's class (``run_job(rank_cls=...)``, ``RayWorkerGroup(rank_cls=...)``), the
ranks' environment (``run_job(job_env=...)``), a rank's phase listeners
(``actors/progress.Progress.listeners``) and its point-to-point transport (``RankWorker.p2p``).

- ``faults``: faults placed at exact points of a job (the fault matrix, the soak bench);
- ``nccl_rules``: point-to-point batches posted under NCCL's rules on gloo;
- ``probes``: ranks for the parallel tests, which run a function on every rank's engine.
"""
