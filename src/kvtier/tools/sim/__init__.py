"""Trace-driven fleet simulator and capacity planner (`kvtier sim`, `kvtier plan`).

    trace = load_trace("mooncake_conversation_trace.jsonl")
    result = simulate(trace, FleetConfig(replicas=16, l0_blocks=292, l1_blocks=2340,
                                         l2_blocks=math.inf), load_costs("gpu-7b"))
    result.hit_rate, result.ttft_p50_ms, result.load_max_over_mean

Routing is the router's own code (`kvtier.router.policies`); see docs/sim.md for the model.
"""

from kvtier.tools.sim.cost_model import CostModel, load_costs
from kvtier.tools.sim.plan import PlanAnswer, plan_capacity
from kvtier.tools.sim.report import SimResult
from kvtier.tools.sim.simulator import FleetConfig, simulate
from kvtier.tools.sim.sweep import SweepAxis, parse_sweep, run_sweep
from kvtier.tools.sim.trace import Trace, TraceRequest, load_trace

__all__ = [
    "CostModel",
    "FleetConfig",
    "PlanAnswer",
    "SimResult",
    "SweepAxis",
    "Trace",
    "TraceRequest",
    "load_costs",
    "load_trace",
    "parse_sweep",
    "plan_capacity",
    "run_sweep",
    "simulate",
]
