"""Warm-up depths: HAPT's thresholds to start from, refined one group link at a time."""
from __future__ import annotations

from hapt_hf.core.schedules import default_warmups, plan_sets_warmups, warmups_from_steps

from ..cost_model import CostModel
from ..simulate import SimResult
from .options import Layout
from .problem import SearchProblem
from .replays import better, simulate_layout

__all__ = ["hapt_warmups", "in_flight_guess", "refine_warmups"]


def hapt_warmups(shapes, cut_s: list[float], cap_s: float, num_microbatches: int,
                 schedule: str) -> tuple[int, ...]:
    """Warm-up depths of stages on the replica tuples ``shapes``: GPipe runs all forwards first;
    1F1B gives stage i ``n - i``; H-1F1B adds 1 per stage inside a group and 1, 2 or 3 across a
    group link (between stages whose first replicas' groups differ) whose transfer takes under a
    tenth, under a half, or more of the stage-time cap (HAPT's thresholds)."""
    n, m = len(shapes), num_microbatches
    if not plan_sets_warmups(schedule):
        return tuple(default_warmups(schedule, n, m))
    steps = []
    for i in range(n - 1):
        inc = 1
        if shapes[i][0].group != shapes[i + 1][0].group:
            ratio = cut_s[i] / cap_s if cap_s > 0 else 1.0
            inc = 1 if ratio < 0.1 else 2 if ratio < 0.5 else 3
        steps.append(inc)
    return warmups_from_steps(steps, m)


def in_flight_guess(shapes, mbs: int, m: int, schedule: str, cm: CostModel,
                    cap_guess: float) -> list[int]:
    """Micro-batches each stage will hold at once, before its layers are known: the warm-up
    depths HAPT's thresholds give with the cut times at a block boundary."""
    if not plan_sets_warmups(schedule):  # the kind fixes the depths
        return default_warmups(schedule, len(shapes), m)
    # cut times at a block boundary stand in for the real boundaries (blocks are alike)
    mid = min(1, cm.model.num_layers - 1)
    cuts = [cm.cut_s(shapes[i], shapes[i + 1], mid, mbs) for i in range(len(shapes) - 1)]
    return list(hapt_warmups(shapes, cuts, cap_guess, m, schedule))


def refine_warmups(problem: SearchProblem, layout: Layout,
                   sim: SimResult | None = None) -> tuple[Layout, SimResult]:
    """Try other warm-up steps across each group link (every cut, in short pipelines), one cut
    at a time, and keep the fastest replay that fits in memory (``sim``: ``layout``'s own
    replay, where already made)."""
    cm, m = problem.cost_model, problem.num_microbatches(layout.micro_batch_size)
    best_l = layout
    best_r = sim if sim is not None else simulate_layout(cm, layout, m)
    if not plan_sets_warmups(layout.schedule):
        return best_l, best_r
    n = layout.num_stages
    cuts = [i for i in range(n - 1)
            if n <= 4 or layout.stages[i].group != layout.stages[i + 1].group]
    for i in cuts:
        steps = [best_l.warmups[j] - best_l.warmups[j + 1] for j in range(n - 1)]
        for step in (1, 2, 3, 4, 6, 8):
            if step == steps[i]:
                continue
            trial = list(steps)
            trial[i] = step
            cand = best_l.with_warmups(warmups_from_steps(trial, m))
            if cand.warmups == best_l.warmups:
                continue
            r = simulate_layout(cm, cand, m)
            if better(r, best_r):
                best_l, best_r = cand, r
    return best_l, best_r
