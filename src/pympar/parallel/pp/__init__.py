"""Pipeline parallelism: stage partition by cost, schedules as action lists, the executor.

    model, ex = build_pipeline(config, seed, mesh.pp_comm, schedule=..., v=..., n_micro=..., dtype=...)
    # = validate_pipeline(...) (ValueError, no communication) + PipelineGPT(...) + PipelineExecutor(...)
    model.zero_grad(); stats = ex.train_step(micro_batches)          # stats["loss"] on every rank
    # gradients, clipping and the update: pympar.parallel.gradsync.GradSync (the trainer's path)
"""
from .executor import PipelineExecutor, build_pipeline
from .partition import Partition, block_flops, partition, validate_pipeline
from .schedules import (SCHEDULES, Action, bubble_formula, build_schedule, gpipe, interleaved_1f1b,
                        one_f_one_b, peak_in_flight, simulate, validate_schedule)
from .stage import PipelineGPT, apply_pp

__all__ = ["PipelineExecutor", "build_pipeline", "PipelineGPT", "apply_pp",
           "Partition", "partition", "validate_pipeline", "block_flops", "SCHEDULES", "Action",
           "build_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "peak_in_flight", "simulate",
           "bubble_formula", "validate_schedule"]
