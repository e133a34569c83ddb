"""Tensor parallelism: the process group (group.py), sharded layers (layers.py), which slice of each checkpoint
tensor a rank loads (sharding.py), the per-step broadcast of the engine's inputs (step_sync.py) and the follower
loop of the ranks other than 0 (worker.py)."""
