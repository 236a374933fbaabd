"""Pipeline schedules as data: generate, lower, validate, simulate and render them.

Pure Python with no torch import, so schedule tooling (the CLI, docs, tests)
starts fast and runs anywhere. The runtime consumes the lowered action lists
produced here. See docs/schedules.md.
"""
from __future__ import annotations

from pipeline_ext.schedules.auto import auto
from pipeline_ext.schedules.balance import (Balance, LayerCost, balance_stages, equal_sizes, evaluate_split, split_min_max,
                                          stage_costs)
from pipeline_ext.schedules.builtin import available, build, default_stages_per_rank
from pipeline_ext.schedules.csv_io import dump_csv, from_cells, load_csv
from pipeline_ext.schedules.fsdp import all_gathers_per_rank, plan_fsdp, strip_fsdp, unshard_counts
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import check_deadlock, forward_only, lower
from pipeline_ext.schedules.nccl_order import Collectives, IssuePolicy, OrderReport, check_fifo_order, model_order
from pipeline_ext.schedules.render import render_ascii, render_png, to_chrome_trace
from pipeline_ext.schedules.select import Selection, select
from pipeline_ext.schedules.simulate import Costs, SimResult, simulate
from pipeline_ext.schedules.validate import validate

__all__ = [
    "dump_csv",
    "from_cells",
    "load_csv",
    "default_stages_per_rank",
    "Action", "ActionKind", "Costs", "Schedule", "ScheduleError", "SimResult", "auto", "available", "build",
    "check_deadlock", "forward_only", "lower", "render_ascii", "render_png", "select", "Selection", "simulate",
    "to_chrome_trace", "validate",
    "Balance", "LayerCost", "balance_stages", "equal_sizes", "evaluate_split", "split_min_max", "stage_costs",
    "Collectives", "IssuePolicy", "OrderReport", "check_fifo_order", "model_order",
    "plan_fsdp", "strip_fsdp", "unshard_counts", "all_gathers_per_rank",
]
