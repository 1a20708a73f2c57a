"""The schedules' lists under NCCL's rules: transfers paired in posting order, one stream per
communicator, a send waiting for its receive (benchmarks/stream_order.py)."""
import pytest
from hypothesis import given, settings, strategies as st

from hapt_hf.core.schedules import ActionKind
from hapt_hf.planner.schedule import Action, Schedule, build_schedule, default_warmups
from benchmarks.stream_order import in_order_hazard


def _h1f1b_warmups(n: int, m: int, extra: list[int]) -> list[int]:
    """Deeper than 1F1B, never shallower further down the pipeline (H-1F1B's shape)."""
    warm, acc = default_warmups("1f1b", n, m), 0
    for i in reversed(range(n)):
        acc += extra[i]
        warm[i] += acc
    return warm


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 7), m=st.integers(1, 12), kind=st.sampled_from(["gpipe", "1f1b", "h1f1b"]),
       extra=st.lists(st.integers(0, 4), min_size=7, max_size=7), early=st.booleans(),
       streams=st.sampled_from(["pair", "group"]))
def test_the_runtimes_groups_finish_every_schedule_on_nccl(n, m, kind, extra, early, streams):
    """One group per boundary and direction, communicators made at set-up (the runtime's
    choice): no list hangs and every receive gets its own micro-batch, whether torch makes a
    communicator per pair or one per group."""
    warm = _h1f1b_warmups(n, m, extra) if kind == "h1f1b" else None
    sched = build_schedule(kind, n, m, warm, early_receives=early)
    assert in_order_hazard(sched, groups="boundary", streams=streams) is None


def test_one_group_for_every_transfer_hangs_1f1b():
    """The default group alone: stage 0 posts its gradient receive of micro-batch 0 before its
    activation send of 1, stage 1 its activation receive of 1 before its gradient send of 0."""
    for early in (False, True):
        sched = build_schedule("1f1b", 2, 4, early_receives=early)
        assert in_order_hazard(sched, groups="one") == \
            "the lists hang: rank 0 at 0RECV_B0, rank 1 at 1RECV_F1"
        assert in_order_hazard(sched, groups="one", streams="group") is not None


def test_one_group_per_direction_hangs_when_torch_makes_one_communicator_per_group():
    """A group per direction over all ranks suffices with pair communicators, but not with
    one communicator per group: a stage's receive from the stage before then stands in front
    of its send to the stage after."""
    sched = build_schedule("1f1b", 4, 8, early_receives=True)
    assert in_order_hazard(sched, groups="direction", streams="pair") is None
    assert in_order_hazard(sched, groups="direction", streams="group") is not None


@pytest.mark.parametrize("kind,n,m", [("gpipe", 2, 4), ("gpipe", 4, 3), ("1f1b", 2, 1)])
def test_communicators_made_by_the_first_transfer_can_hang(kind, n, m):
    """NCCL makes a pair's communicator on its first transfer, blocking both hosts: GPipe's
    first stage posts its gradient receive before its last activation send. The runtime makes
    them at set-up (process_group.transfer_groups)."""
    sched = build_schedule(kind, n, m, early_receives=True)
    assert in_order_hazard(sched, made_at_setup=False) is not None
    assert in_order_hazard(sched) is None


def test_a_receive_order_unlike_the_send_order_is_named():
    """Tags do not pair NCCL's transfers: micro-batches received out of their send order would
    swap their data."""
    sched = build_schedule("gpipe", 2, 2, validate=False)
    lst = list(sched.actions[1])
    i, j = lst.index(Action(1, ActionKind.RECV_F, 0)), lst.index(Action(1, ActionKind.RECV_F, 1))
    lst[i], lst[j] = lst[j], lst[i]
    swapped = Schedule(sched.name, 2, 2, sched.warmups, (sched.actions[0], tuple(lst)))
    found = in_order_hazard(swapped)
    assert found is not None and "send of micro-batch 0 would land in rank 1's receive of " \
        "micro-batch 1" in found


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="groups must be one of"):
        in_order_hazard(build_schedule("1f1b", 2, 2), groups="pairs")
