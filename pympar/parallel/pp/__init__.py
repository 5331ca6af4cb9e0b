"""Pipeline parallelism: stage partition by cost, schedules as action lists, the executor.

    part = validate_pipeline(config, pp, n_micro, schedule, v)        # ValueError, no communication
    model = PipelineGPT(config, seed, pp=pp, rank=pp_rank, v=v, dtype=..., factory=None)
    ex = PipelineExecutor(model, mesh.pp_comm, schedule)
    model.zero_grad(); stats = ex.train_step(micro_batches)          # stats["loss"] on every rank
    clip_grad_norm(model.parameters(), max_norm, allreduce_sq=pp_allreduce_sq(model, mesh.pp_comm))
"""
from .executor import PipelineExecutor
from .partition import Partition, block_flops, partition, validate_pipeline
from .schedules import (SCHEDULES, Action, bubble_formula, build_schedule, gpipe, interleaved_1f1b,
                        one_f_one_b, peak_in_flight, simulate, validate_schedule)
from .stage import GPTPartsFactory, PipelineGPT, SlicedModelFactory, StageChunk, pp_allreduce_sq

__all__ = ["PipelineExecutor", "PipelineGPT", "pp_allreduce_sq", "GPTPartsFactory", "SlicedModelFactory", "StageChunk",
           "Partition", "partition", "validate_pipeline", "block_flops", "SCHEDULES", "Action",
           "build_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "peak_in_flight", "simulate",
           "bubble_formula", "validate_schedule"]
