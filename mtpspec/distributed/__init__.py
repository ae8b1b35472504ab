"""Process groups, collectives with byte counters, sequence-parallel helpers, launcher."""

from mtpspec.distributed.communication_op import (
    comm_stats, reset_comm_stats, sp_all_gather, sp_shard, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce, tensor_model_parallel_reduce_scatter, total_comm_bytes)
from mtpspec.distributed.launcher import launch
from mtpspec.distributed.parallel_state import (
    GroupCoordinator, default_backend, destroy_distributed_environment, get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size, get_tp_group, init_distributed_environment)

__all__ = [
    "GroupCoordinator", "comm_stats", "default_backend", "destroy_distributed_environment",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
    "init_distributed_environment", "launch", "reset_comm_stats", "sp_all_gather", "sp_shard",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_reduce_scatter", "total_comm_bytes",
]
