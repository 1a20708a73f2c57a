"""Private torch APIs hapt_hf needs (tested on torch 2.13).

The replay of a model's initialisation (:mod:`hapt_hf.pipeline.init_replay`) intercepts every
tensor factory and every in-place op: torch offers no public way to list the factories that
take a ``device=`` argument, to subclass a dispatch mode, to read which argument an op
writes, or to identify a storage; the model reader runs a layer on fake tensors (shapes and
dtypes, no memory) through torch's ``FakeTensorMode``. The pipeline's failure records
(:mod:`hapt_hf.pipeline.failure`) live in the rendezvous store the launcher set up, which torch
hands out only through a private accessor. A sharded optimizer that steps in place of the
user's tells the user's LR scheduler so, as the scheduler's own step hook would. A backward split
into its input and weight gradients (the ``zero_bubble`` schedule) runs as torch's pipelining
runs it, through its private helpers.
The runtime keeps one 16-bit copy of each weight for all the micro-batches of a step
(:class:`hapt_hf.pipeline.precision.SharedWeightCasts`): it tells autocast's casts of a weight
among the tensors autograd saves from the graph autograd records for them, and composes its
saved-tensor hooks with those already in force; a frozen weight, whose casts autograd records
nothing for, it casts once itself and puts in place of the parameter while a projection's
forward reads it. A checkpoint reader that copies a saved tensor's bytes straight into the
tensor they load into finds where they lie in ``torch.save``'s record through torch's own zip
reader.
"""
from __future__ import annotations

import sys
from typing import IO, Any, Callable

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchMode", "device_factories", "written_arguments", "storage_key", "fake_tensors",
           "is_fake", "outside_fake_tensors", "default_store", "mark_stepped_for_schedulers",
           "backward_input", "backward_weight", "cast_parameter", "saved_tensors_hooks_in_force",
           "swap_parameter", "saved_tensor_layout"]


class DispatchMode(TorchDispatchMode):
    """torch's ``TorchDispatchMode``: a context that sees every aten op below autograd.

    Subclasses define ``__torch_dispatch__(self, func, types, args, kwargs)``.
    Tested on torch 2.13 (``torch.utils._python_dispatch``, present since torch 1.13).
    """


def device_factories() -> frozenset[Callable[..., Any]]:
    """The tensor factories ``with torch.device(...)`` redirects (torch.empty, torch.zeros...).

    Tested on torch 2.13 (``torch.utils._device._device_constructors``, since torch 2.0).
    """
    return frozenset(_device_constructors())


def written_arguments(func: Any, args: tuple) -> list[int]:
    """Positions, among ``args``, of the arguments the aten op ``func`` writes in place.

    Read from the op's schema. Tested on torch 2.13 (``OpOverload._schema``,
    ``Argument.alias_info.is_write``).
    """
    return [i for i, schema_arg in enumerate(func._schema.arguments[:len(args)])
            if schema_arg.alias_info is not None and schema_arg.alias_info.is_write]


def storage_key(tensor: Tensor) -> int:
    """An identity of the tensor's storage, shared by its views, on every device (meta too).

    Valid while the storage is alive. Tested on torch 2.13 (``UntypedStorage._cdata``; a
    meta storage has no ``data_ptr`` to tell storages apart).
    """
    return tensor.untyped_storage()._cdata


def fake_tensors():
    """A context in which every tensor made is fake: shapes, dtypes and devices as real ones,
    no data and no memory (the ops run through their meta kernels). Real tensors met inside
    are taken in as fake.

    Tested on torch 2.13 (``torch._subclasses.fake_tensor.FakeTensorMode``, since torch 2.0).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (see :func:`fake_tensors`).

    Tested on torch 2.13 (``torch._subclasses.fake_tensor.is_fake``, since torch 2.0).
    """
    from torch._subclasses.fake_tensor import is_fake as _is_fake
    return _is_fake(tensor)


def outside_fake_tensors():
    """A context in which ops run on real tensors again, inside a :func:`fake_tensors` one (a
    no-op outside any).

    Tested on torch 2.13 (``torch._subclasses.fake_tensor.unset_fake_temporarily``, since
    torch 2.1).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


def default_store() -> Any:
    """The default process group's rendezvous store (a ``torch.distributed.Store``): the one
    every launcher (torchrun, accelerate, ``env://``) already set up, shared by every rank.

    Tested on torch 2.13 (``torch.distributed.distributed_c10d._get_default_store``, since
    torch 1.8); the process group must be initialised.
    """
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


def mark_stepped_for_schedulers(optimizer: Any) -> None:
    """Record on ``optimizer`` that it stepped, as the step wrapper an LR scheduler installs on
    the optimizer it is built on would: a sharded optimizer made from a user's optimizer steps
    in its place, and the scheduler (built on the user's) would otherwise warn on its first
    step that ``lr_scheduler.step()`` ran before ``optimizer.step()``.

    Tested on torch 2.13 (``LRScheduler`` checks ``optimizer._opt_called``, since torch 1.1).
    """
    optimizer._opt_called = True


def backward_input(outputs: list[Tensor], output_grads: list[Tensor] | None, inputs: list[Tensor],
                   weights: Any) -> tuple[tuple[Tensor | None, ...], Any]:
    """The input gradients of a stage's backward only (written to each input's ``.grad`` and
    returned), and what :func:`backward_weight` needs to finish it: the gradients reaching the
    graph nodes that lead to ``weights``, kept by hooks while the input gradients ran (the
    graph is retained). ``output_grads`` None: ``outputs`` is the loss. The outputs are
    detached in place. The stage's inputs must require gradients.

    Tested on torch 2.13 (``torch.distributed.pipelining._backward.stage_backward_input``,
    since torch 2.5).
    """
    from torch.distributed.pipelining._backward import stage_backward_input
    return stage_backward_input(outputs, output_grads, inputs, weights)


def backward_weight(weights: Any, state: Any,
                    after_group: Callable[[list[Any]], None] | None = None) -> None:
    """The weight gradients of a backward that :func:`backward_input` began, added to each
    weight's ``.grad`` (set where None) as the whole backward adds them; ``weights`` as given
    there. ``after_group``: called with the weights of each group of them as soon as their
    gradients are in (a bucket all-reduce may start on them while the others run).

    Tested on torch 2.13 (``torch.distributed.pipelining._backward.stage_backward_weight``,
    since torch 2.5: its weight groups, ``params`` the weights' gradient accumulators, are
    run one by one here as it runs them).
    """
    from torch.distributed.pipelining._backward import stage_backward_weight
    if after_group is None:
        stage_backward_weight(weights, state)
        return
    # a weight's gradient accumulator, found as torch's helpers find it
    owner = {w.view_as(w).grad_fn.next_functions[0][0]: w for w in weights if w.requires_grad}
    for group in state:
        members = [owner[acc] for acc in group["params"]]
        stage_backward_weight(members, [group])
        after_group(members)


def cast_parameter(t: Tensor) -> Tensor | None:
    """The parameter ``t`` is a dtype cast of, or a view of such a cast, as autograd recorded
    it (the cast's node ``ToCopyBackward0`` leads to the parameter's gradient accumulator);
    None for any other tensor. Works on DTensors alike.

    autocast casts a weight with ``arg.to(dtype)`` (``cached_cast`` in
    aten/src/ATen/autocast_mode.cpp), whose backward is ``ToCopyBackward0`` (``_to_copy`` in
    tools/autograd/derivatives.yaml); a leaf's gradient accumulator names the leaf as
    ``AccumulateGrad.variable`` (torch/csrc/autograd/functions/init.cpp). A view (a
    projection's ``weight.t()``) knows the cast it views as ``Tensor._base``. Tested on torch
    2.13.
    """
    base = t._base if t._base is not None else t
    node = base.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
        return None
    source = getattr(node.next_functions[0][0], "variable", None)
    return source if isinstance(source, Parameter) else None


def saved_tensors_hooks_in_force() -> tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None:
    """The (pack, unpack) hooks of the innermost ``torch.autograd.graph.saved_tensors_hooks``
    context in force on this thread, None outside any: a context entered inside another
    replaces it, so one that handles only some tensors passes the others to these.

    Tested on torch 2.13 (``torch._C._autograd._top_saved_tensors_default_hooks``; its
    argument: whether to ignore a tracing state, False here).
    """
    from torch._C import _autograd
    return _autograd._top_saved_tensors_default_hooks(False)


def swap_parameter(module: Module, name: str, tensor: Tensor) -> Tensor:
    """Put ``tensor`` where ``module`` holds its parameter ``name``, and return what was there:
    ``module.<name>`` reads ``tensor`` until it is swapped back (a plain tensor may stand in
    for a parameter, which ``setattr`` refuses).

    Tested on torch 2.13 (``Module._parameters``, the dict ``Module.__getattr__`` reads a
    parameter from; ``torch.nn.utils.stateless._reparametrize_module`` swaps them alike).
    """
    held = module._parameters[name]
    module._parameters[name] = tensor
    return held


def saved_tensor_layout(stream: IO[bytes]) -> tuple[Tensor, int] | None:
    """The tensor one ``torch.save`` wrote into ``stream`` (seekable, positions counted from
    the record's first byte) as a meta tensor (dtype, shape, strides, storage offset; no data),
    and the position in ``stream`` of its storage's first byte, stored raw (``torch.save``
    never compresses a storage) in this machine's byte order. None where the record holds no
    plain tensor or its bytes are in the other byte order (``torch.load`` swaps those).

    The pickle is read as ``torch.load(map_location="meta")`` reads it (no storage read);
    where the storage lies is what that load records on the meta storage, and the byte order
    is the record's ``byteorder`` entry (absent: little-endian, ``torch.load``'s default), read
    with ``torch.load``'s own zip reader. Tested on torch 2.13 (``torch._C.PyTorchFileReader``,
    ``UntypedStorage._checkpoint_offset``, set by ``torch.serialization._load`` since torch 2.1).
    """
    records = torch._C.PyTorchFileReader(stream)
    order = records.get_record("byteorder") if records.has_record("byteorder") else b"little"
    if bytes(order).decode() != sys.byteorder:
        return None
    stream.seek(0)
    meta = torch.load(stream, map_location="meta", weights_only=True)
    if type(meta) is not Tensor or not meta.is_meta or meta.layout != torch.strided:
        return None
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    return (meta, offset) if isinstance(offset, int) else None
