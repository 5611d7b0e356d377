"""Pipeline (model-parallel) training: a model split into stages, one process each, with
every activation and gradient that crosses a stage written one-sided into receive slots
registered once.

The API mirrors ``torch.distributed.pipelining``, so a port is an import swap and needs no
process group::

    from tensorx import pipelining as pp

    stage = pp.PipelineStage(submodule, stage_index, num_stages, device)
    sched = pp.Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    with stage:
        sched.step(x)                        # first stage
        sched.step(target=y, losses=losses)  # last stage; the others: sched.step()

See docs/pipelining.md.
"""

from __future__ import annotations

from tensorx.pipelining._boundary import BoundaryRow, StagePlan
from tensorx.pipelining._schedules import PipelineScheduleSingle, Schedule1F1B, ScheduleGPipe
from tensorx.pipelining._split import Crossing, Pipe, build_stage, split
from tensorx.pipelining._stage import PipelineStage

__all__ = ["BoundaryRow", "Crossing", "Pipe", "PipelineScheduleSingle", "PipelineStage",
           "Schedule1F1B", "ScheduleGPipe", "StagePlan", "build_stage", "split"]
