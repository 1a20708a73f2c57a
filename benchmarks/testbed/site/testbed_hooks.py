"""The testbed's torch patches (see sitecustomize.py for what they emulate and why)."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


class _Mark(torch.autograd.Function):
    """Identity whose backward notes the time (at a module's output: its backward starts)."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box["t0"] = time.perf_counter()
        return g, None


class _Delay(torch.autograd.Function):
    """Identity whose backward (at a module's input: its backward ended) sleeps the extra time."""

    @staticmethod
    def forward(ctx, x, box, factor):
        ctx.box, ctx.factor = box, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        t0 = ctx.box.get("t0")
        if t0 is not None:
            time.sleep(max(0.0, (ctx.factor - 1.0) * (time.perf_counter() - t0)))
            ctx.box["t0"] = None  # one delay per backward even if several inputs need grad
        return g, None, None


def install_slowdown(factor: float) -> list:
    """Slow every leaf module down by ``factor``; returns the hook handles (``.remove()``)."""
    def is_leaf(m):
        return next(m.children(), None) is None

    def pre(module, args):
        if not is_leaf(module):
            return None
        box = {}
        module._tb_box, module._tb_t = box, time.perf_counter()
        if torch.is_grad_enabled():
            args = tuple(_Delay.apply(a, box, factor) if isinstance(a, torch.Tensor)
                         and a.requires_grad else a for a in args)
            return args
        return None

    def post(module, args, out):
        if not is_leaf(module) or not hasattr(module, "_tb_t"):
            return None
        time.sleep(max(0.0, (factor - 1.0) * (time.perf_counter() - module._tb_t)))
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            return _Mark.apply(out, module._tb_box)
        return None

    return [torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post)]


def install_shim(cfg: dict) -> None:
    """Hold back each send to another group by latency + bytes / bandwidth.

    Patched on ProcessGroup.send, which dist.send, dist.isend and batch_isend_irecv all reach,
    so every framework's p2p goes through it. The sender waits before handing the tensor over:
    a pessimistic link (the wait does not overlap the sender's compute), see docs/testbed.md.
    """
    group_of = cfg["group_of_rank"]
    links = {tuple(k.split("|")): v for k, v in cfg["links"].items()}
    pg_cls = torch._C._distributed_c10d.ProcessGroup
    orig_send = pg_cls.send

    def send(self, tensors, dst, tag=0):
        try:
            peer = dist.get_global_rank(self, dst)
        except (RuntimeError, ValueError):
            peer = dst  # the default group: local and global ranks agree
        a, b = group_of[dist.get_rank()], group_of[peer]
        if a != b:
            mbps, lat_ms = links.get((a, b)) or links.get((b, a)) or (0.0, 0.0)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            time.sleep(lat_ms * 1e-3 + (nbytes * 8 / (mbps * 1e6) if mbps else 0.0))
        return orig_send(self, tensors, dst, tag)

    pg_cls.send = send


if os.environ.get("HAPT_TESTBED_SLOWDOWN"):
    _f = float(os.environ["HAPT_TESTBED_SLOWDOWN"])
    if _f > 1.0:
        install_slowdown(_f)
if os.environ.get("HAPT_TESTBED_SHIM"):
    install_shim(json.loads(os.environ["HAPT_TESTBED_SHIM"]))
