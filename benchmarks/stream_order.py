"""A yardstick for tests (not shipped): whether a schedule's per-rank lists finish on a
transport that runs transfers in posting order (NCCL).

:func:`~hapt_hf.planner.schedule.validate_schedule` replays the lists as Gloo runs them: every
transfer is matched by its tag and moves on its own, so a receive posted early holds nothing up.
NCCL works differently, and :func:`in_order_hazard` replays the lists under its rules:

* **Matching in order.** Between two ranks, NCCL pairs the k-th send of one with the k-th receive
  of the other, in the order they were posted; the tag is ignored. A stage that posts its
  receives in a different micro-batch order from the one its neighbour sends in would get the
  wrong micro-batch's data.
* **One stream per communicator.** torch gives each pair of ranks of a process group its own
  NCCL communicator and CUDA stream, and posts both directions of that pair on it. A receive at
  the head of the stream waits for its data; whatever was posted behind it waits as well.
* **A send waits for its receive.** A send larger than NCCL's buffers (a few MB: an activation
  of one 4k-token sample at hidden size 4096 is 32 MB in bf16) completes only once the receive
  runs on the other side. The replay assumes every send is that large.
* **Stream order with compute.** A transfer starts after the compute posted before it (torch
  makes the communication stream wait for the current one); a compute that consumes a receive
  waits for it.
* **The host.** Each rank posts its list in order. The first transfer of a pair on a
  communicator also creates it, which blocks both hosts until both get there; the last stage
  reads each forward's loss into host memory, which blocks its host until that forward is done.

The replay builds the graph of these dependencies (a send and its receive are one node, the two
hosts' first posts on a communicator are one node) and reports a cycle: the lists would hang.

Every kind's lists replay: a split backward's ``I`` waits for its gradient's receive as ``B``
does and its send follows it; ``W`` is compute on the rank's stream and transfers nothing.
Under an interleaved schedule each virtual stage boundary (stage ``s`` to ``s + 1``, rank
``s mod p`` to rank ``(s + 1) mod p``) is a boundary of its own.

What it shows (tests/planner/test_stream_order.py): on the default group alone, 1F1B's lists
hang (the stage before posts its gradient receive of micro-batch 0 before its activation send of
1, the stage after its activation receive of 1 before its gradient send of 0); on one group per
stage boundary and direction, with the communicators made before the lists start, no list of
any schedule hangs, whichever way torch makes communicators. That is what the runtime does
(:func:`hapt_hf.pipeline.process_group.transfer_groups`).

The replay covers the lists only: the gradient all-reduces, launched from the last backward on,
run on the replica groups' own communicators, in the same order on every replica.
"""
from __future__ import annotations

from collections import defaultdict

from hapt_hf.core.schedules import BACKWARDS, ActionKind
from hapt_hf.planner.plan import Plan
from hapt_hf.planner.schedule import Action, Schedule

__all__ = ["in_order_hazard", "plan_in_order_hazard", "GROUPINGS", "STREAMS"]

_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
_FORWARD = (ActionKind.SEND_F, ActionKind.RECV_F)
GROUPINGS = ("one", "direction", "boundary")
STREAMS = ("pair", "group")


def in_order_hazard(sched: Schedule, *, groups: str = "boundary", streams: str = "pair",
                    made_at_setup: bool = True) -> str | None:
    """Why ``sched``'s lists would hang or mix up micro-batches under NCCL's rules (above),
    or None when they finish.

    ``groups``: which process group carries a transfer: ``"one"`` (the default group, every
    transfer), ``"direction"`` (one group for activations, one for gradients) or
    ``"boundary"`` (one group per stage boundary and direction: the runtime's).
    ``streams``: ``"pair"``, torch's communicator per pair of ranks of a group, made by their
    first transfer; ``"group"``, one communicator and stream per group, all peers on it (a
    default group initialised with ``device_id``, which torch then makes eagerly).
    ``made_at_setup``: the pair communicators already exist when the lists start (the
    runtime's set-up makes them); otherwise a pair's first transfer blocks both hosts."""
    def peers(r: int, a: Action) -> list[int]:
        return [sched.rank_of(a.stage + 1 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B)
                              else a.stage - 1)]
    return _hazard(dict(enumerate(sched.actions)), peers, sched.num_stages, groups, streams,
                   made_at_setup)


def plan_in_order_hazard(plan: Plan, *, groups: str = "boundary", streams: str = "pair",
                         made_at_setup: bool = True) -> str | None:
    """:func:`in_order_hazard` over a plan's global ranks: every rank of every replica runs its
    pipeline rank's list, and each of its transfers goes to the ranks the runtime pairs it with
    (:func:`hapt_hf.pipeline.placement.rank_works`, one per stage the rank holds: the pieces
    each replica trades with the neighbouring stage's replicas, and under tensor parallelism
    the TP rank each pairs with), one transfer per piece, posted in piece order as the runtime
    posts them. The ranks of a tensor-parallel replica run each compute together (its
    all-reduces join them): each of their computes is one node, ready when every one of them
    could start it."""
    from hapt_hf.pipeline.placement import rank_works
    works = {(r, w.stage.index): w for r in range(plan.world_size)
             for w in rank_works(plan, r)}  # an interleaved rank: one per stage it holds
    pieces = {ActionKind.RECV_F: "upstream", ActionKind.SEND_B: "upstream_grads",
              ActionKind.SEND_F: "downstream", ActionKind.RECV_B: "downstream_grads"}

    def peers(r: int, a: Action) -> list[int]:
        return [p.peer for p in getattr(works[(r, a.stage)], pieces[a.kind])]
    joint = list(dict.fromkeys(rep.ranks for s in plan.stages for rep in s.replicas
                               if len(rep.ranks) > 1))
    lists = {r: w.actions for (r, _), w in works.items()}  # a rank's whole list, on each work
    return _hazard(lists, peers, plan.num_stages, groups, streams, made_at_setup, joint)


def _hazard(lists: dict[int, tuple[Action, ...]], peers, n: int, groups: str, streams: str,
            made_at_setup: bool, joint: list[tuple[int, ...]] = ()) -> str | None:
    """The replay: ``lists`` by rank, ``peers(rank, action)`` the ranks a transfer action
    posts to or from, in posting order; ``n`` stages; ``joint``: groups of ranks that run the
    same list and whose computes at the same place are one (a tensor-parallel replica's)."""
    if groups not in GROUPINGS or streams not in STREAMS:
        raise ValueError(f"groups must be one of {GROUPINGS} and streams one of {STREAMS}")
    parent: dict[tuple, tuple] = {}

    def find(x: tuple) -> tuple:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges: list[tuple[tuple, tuple]] = []
    sends: dict[tuple, list[tuple[tuple, int]]] = defaultdict(list)  # (chan, src, dst)
    recvs: dict[tuple, list[tuple[tuple, int]]] = defaultdict(list)
    first_post: dict[tuple, tuple] = {}  # (chan, rank) -> host node of its first transfer
    for r, lst in lists.items():
        last_compute = prev_host = host_sync = None
        tail: dict[object, tuple] = {}  # stream -> its last node
        received: dict[tuple[int, bool, int], list[tuple]] = {}
        for j, a in enumerate(lst):
            host = ("H", r, j)
            for before in (prev_host, host_sync):
                if before is not None:
                    edges.append((before, host))
            prev_host, host_sync = host, None
            s, k = a.stage, a.microbatch
            if a.is_compute:
                node = ("G", r, j)
                edges.append((host, node))
                fwd = a.kind is ActionKind.F
                # F and the backward that feeds the stage before (B, I) wait for their receive;
                # a weight gradient W for its own I only (stream order, above)
                if (fwd and s > 0) or (a.kind in BACKWARDS and s < n - 1):
                    edges += [(x, node) for x in received[(s, fwd, k)]]
                last_compute = node
                if fwd and s == n - 1:
                    host_sync = node  # the loss read back to the host
                if "compute" in tail:
                    edges.append((tail["compute"], node))
                tail["compute"] = node
                continue
            fwd = a.kind in _FORWARD
            edge = s if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else s - 1
            chan = {"one": ("all",), "direction": ("all", fwd), "boundary": (edge, fwd)}[groups]
            received.setdefault((s, fwd, k), [])
            edges.append((host, ("G", r, j)))  # the action's node, even with nothing to post
            # one transfer per peer, posted in order; the action's node is the first one
            for i, peer in enumerate(peers(r, a)):
                node = ("G", r, j) if i == 0 else ("G", r, j, i)
                edges.append((host, node))
                stream = (chan, frozenset((r, peer))) if streams == "pair" else chan
                if streams == "pair" and not made_at_setup:
                    first_post.setdefault((stream, r), host)
                if last_compute is not None:
                    edges.append((last_compute, node))
                if a.kind in _SENDS:
                    sends[(chan, r, peer)].append((node, k))
                else:
                    recvs[(chan, peer, r)].append((node, k))
                    received[(s, fwd, k)].append(node)
                if stream in tail:
                    edges.append((tail[stream], node))
                tail[stream] = node
    for key in set(sends) | set(recvs):
        out, into = sends.get(key, []), recvs.get(key, [])
        _, src, dst = key
        if len(out) != len(into):
            return (f"rank {src} posts {len(out)} sends to rank {dst} but rank {dst} posts "
                    f"{len(into)} receives from it")
        for (snd, k), (rcv, k2) in zip(out, into):
            if k != k2:
                return (f"rank {src}'s send of micro-batch {k} would land in rank {dst}'s "
                        f"receive of micro-batch {k2}: NCCL matches a pair's transfers in "
                        "posting order, not by tag")
            parent[find(snd)] = find(rcv)
    by_comm: dict[object, list[tuple]] = defaultdict(list)
    for (stream, _), host in first_post.items():
        by_comm[stream].append(host)
    for hosts in by_comm.values():
        for h in hosts[1:]:
            parent[find(h)] = find(hosts[0])
    for ranks in joint:
        for j, a in enumerate(lists[ranks[0]]):
            if a.is_compute:
                for r in ranks[1:]:
                    parent[find(("G", r, j))] = find(("G", ranks[0], j))
    return _cycle(lists, {(find(u), find(v)) for u, v in edges}, find)


def _cycle(lists: dict[int, tuple[Action, ...]], edges: set[tuple[tuple, tuple]],
           find) -> str | None:
    """Kahn's order over the merged nodes; where it stops, each rank's first action left."""
    succ: dict[tuple, list[tuple]] = defaultdict(list)
    indeg: dict[tuple, int] = defaultdict(int)
    nodes = {find(x) for e in edges for x in e}
    for u, v in edges:  # a node that waits on itself (u == v) never becomes ready
        succ[u].append(v)
        indeg[v] += 1
    ready = [x for x in nodes if indeg[x] == 0]
    done: set[tuple] = set()
    while ready:
        x = ready.pop()
        done.add(x)
        for y in succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    if len(done) == len(nodes):
        return None
    stuck = []
    for r, lst in lists.items():
        j = next((j for j in range(len(lst)) if find(("G", r, j)) not in done), None)
        if j is not None:
            stuck.append(f"rank {r} at {lst[j]}")
    return "the lists hang: " + ", ".join(stuck)
