"""Tensor parallelism (--tensor-parallel-size): sharded layers, the process group, worker processes."""
