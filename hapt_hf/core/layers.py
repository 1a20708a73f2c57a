"""The layer sequence the planner cuts and the runtime builds, in its two units.

``block``: ``[embedding, block_0 .. block_{N-1}, head]``, ``N + 2`` layers.
``half``: every block cut in two (HAPT's fine-grained layers),
``[embedding, b0.attn, b0.mlp, b1.attn, ..., head]``, ``2 * N + 2`` layers.

Layer 0 is always the embedding and the last layer the head; a stage holds a half-open range.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOCK", "HALF", "LAYER_UNITS", "BlockPart", "layers_per_block", "num_layers",
           "num_blocks", "body_part", "block_parts", "layer_name", "layer_names",
           "block_boundary_in_halves"]

BLOCK = "block"
HALF = "half"
LAYER_UNITS = (BLOCK, HALF)
"""What one entry of the layer sequence is: a whole transformer block, or half of one."""


@dataclass(frozen=True)
class BlockPart:
    """What a stage runs of one transformer block: all of it, or one of its two halves."""

    index: int
    """Block index, 0-based."""
    part: str
    """'full' | 'attn' (norm, attention, residual) | 'mlp' (norm, MLP, residual)."""


def layers_per_block(unit: str) -> int:
    """Entries of the layer sequence one transformer block takes."""
    return 2 if unit == HALF else 1


def num_layers(blocks: int, unit: str = BLOCK) -> int:
    """Length of the layer sequence of a model of ``blocks`` blocks (+ embedding and head)."""
    return layers_per_block(unit) * blocks + 2


def num_blocks(layers: int, unit: str = BLOCK) -> int:
    """Transformer blocks of a layer sequence of length ``layers``."""
    return (layers - 2) // layers_per_block(unit)


def body_part(layer: int, unit: str = BLOCK) -> BlockPart:
    """The block (or half) that entry ``layer`` of the sequence is (1 <= layer <= last block)."""
    if unit == HALF:
        index, second = divmod(layer - 1, 2)
        return BlockPart(index, "mlp" if second else "attn")
    return BlockPart(layer - 1, "full")


def block_parts(layer_range: tuple[int, int], blocks: int,
                unit: str = BLOCK) -> tuple[BlockPart, ...]:
    """The blocks (or halves) a layer range covers, in order; a block whose two halves both
    fall in the range is run whole."""
    start, end = layer_range
    head = num_layers(blocks, unit) - 1
    parts: list[BlockPart] = []
    for layer in range(max(start, 1), min(end, head)):
        p = body_part(layer, unit)
        if p.part == "mlp" and parts and parts[-1] == BlockPart(p.index, "attn"):
            parts[-1] = BlockPart(p.index, "full")
        else:
            parts.append(p)
    return tuple(parts)


def layer_name(layer: int, total: int, unit: str = BLOCK) -> str:
    """One entry in words: ``emb``, ``head``, ``b3``, or ``b3.attn`` / ``b3.mlp`` for halves."""
    if layer == 0:
        return "emb"
    if layer == total - 1:
        return "head"
    p = body_part(layer, unit)
    return f"b{p.index}" if p.part == "full" else f"b{p.index}.{p.part}"


def layer_names(layers: tuple[int, int], total: int, unit: str = BLOCK) -> str:
    """A half-open range of a sequence of ``total`` layers in words, e.g. ``emb,b0-b3``.

    With ``unit='half'`` a range that starts or ends inside a block names the half
    (``b3.mlp-b7.attn``); whole blocks are named by their index alone.
    """
    start, end = layers
    parts: list[str] = []
    if start == 0:
        parts.append("emb")
    first, last = max(start, 1), min(end, total - 1) - 1  # body entries, inclusive
    if last == first:
        parts.append(layer_name(first, total, unit))
    elif last > first:
        a, b = body_part(first, unit), body_part(last, unit)
        head = f"b{a.index}.mlp" if a.part == "mlp" else f"b{a.index}"
        tail = f"b{b.index}.attn" if b.part == "attn" else f"b{b.index}"
        parts.append(head if head == tail else f"{head}-{tail}")
    if end == total:
        parts.append("head")
    return ",".join(parts)


def block_boundary_in_halves(boundary: int, blocks: int) -> int:
    """A stage boundary of the whole-block sequence, as a position in the half-block one.

    Boundary ``b`` (0 < b < blocks + 2) ends after block ``b - 2``, i.e. after its MLP half.
    """
    if boundary == 0:
        return 0
    if boundary == num_layers(blocks, BLOCK):
        return num_layers(blocks, HALF)
    return 2 * boundary - 1
