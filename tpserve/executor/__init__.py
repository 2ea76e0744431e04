"""Executors: how the engine reaches the model shards. The engine sees only the Executor
interface (base.py); whoever launches the engine (the driver, a test, a benchmark) builds
one: InProcessExecutor (tp = 1 in this process, no Ray) or RayExecutor (tp shard actors)."""
