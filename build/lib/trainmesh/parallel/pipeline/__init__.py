"""Pipeline parallelism: schedule IR, generators, simulator, executor."""
