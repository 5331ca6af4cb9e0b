"""Pipeline parallelism: stage partition by cost, schedules as action lists, the executor.

    model, ex = build_pipeline(config, seed, mesh.pp_comm, schedule=..., v=..., n_micro=..., dtype=...)
    # = validate_pipeline(...) (ValueError, no communication) + PipelineGPT(...) + PipelineExecutor(...)
    model.zero_grad(); stats = ex.train_step(micro_batches)          # stats["loss"] on every rank
    clip_grad_norm(model.parameters(), max_norm, allreduce_sq=pp_allreduce_sq(model, mesh.pp_comm))
"""
from .executor import PipelineExecutor, build_pipeline
from .partition import Partition, block_flops, partition, validate_pipeline
from .schedules import (SCHEDULES, Action, bubble_formula, build_schedule, gpipe, interleaved_1f1b,
                        one_f_one_b, peak_in_flight, simulate, validate_schedule)
from .stage import GPTPartsFactory, PipelineGPT, SlicedModelFactory, StageChunk, pp_allreduce_sq

__all__ = ["PipelineExecutor", "build_pipeline", "PipelineGPT", "pp_allreduce_sq", "GPTPartsFactory", "SlicedModelFactory", "StageChunk",
           "Partition", "partition", "validate_pipeline", "block_flops", "SCHEDULES", "Action",
           "build_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "peak_in_flight", "simulate",
           "bubble_formula", "validate_schedule"]
