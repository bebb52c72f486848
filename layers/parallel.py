"""Tensor / expert parallelism as the layers see it: this process's rank among
`world_size`, the collectives a sharded layer calls, and how each parameter is cut from the
checkpoint's full tensor.

A layer built with a `ParallelContext` of world size N holds only its rank's share of the
weights (heads, groups, channels, experts or vocabulary rows) and calls `all_reduce` /
`all_gather` where partial results meet. It records on each sharded parameter how its local
tensor is cut from the full one (`set_shard`); the loader and the dummy initializer apply
that cut (`Shard.cut`) to full checkpoint tensors, so every rank loads the same files and
random weights are the same model at every N. World size 1 (`SINGLE`) makes every
collective a no-op and every cut the identity. The linear layers run their op set's
`linear` (a reference `F.linear`, or the fast op's few-row kernel at decode).

The sharded building blocks: `ColumnParallelLinear` (output rows cut),
`RowParallelLinear` (input columns cut, outputs summed), `VocabParallelEmbedding` and
`ParallelLMHead` (vocabulary rows cut, padded to an even share).
"""
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers.kernels.ops import KernelOps

# all_gather_single is the current name of all_gather_into_tensor (torch >= 2.10).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Shard:
    """A local tensor = the concatenation, along `dim`, of the full tensor's index ranges
    `ranges` ([start, stop) each, in order); indices at or past `full_size` are zero
    padding (a vocabulary that does not divide by the world size)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_size: int

    @property
    def local_size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given the local one."""
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (padded with zeros past `full_size`)."""
        pieces = []
        for start, stop in self.ranges:
            real = max(0, min(stop, self.full_size) - start)
            if real:
                pieces.append(full.narrow(self.dim, start, real))
            if stop - start > real:
                shape = list(full.shape)
                shape[self.dim] = stop - start - real
                pieces.append(full.new_zeros(shape))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def full_index(self, local: int) -> int | None:
        """The full tensor's index along `dim` of local index `local` (None: padding)."""
        for start, stop in self.ranges:
            if local < stop - start:
                return start + local if start + local < self.full_size else None
            local -= stop - start
        raise IndexError(f"local index past the shard's {self.local_size} rows")

    @property
    def is_whole(self) -> bool:
        """The cut takes the full tensor as it is (world size 1)."""
        return self.ranges == ((0, self.full_size),)


def block_shard(dim: int, full_size: int, blocks: Iterable[tuple[int, int, int, int]]) -> Shard:
    """The cut of a fused tensor made of blocks: from each block `(offset, unit, start, stop)`
    (the block starts at row `offset` and holds items of `unit` rows) take items [start, stop)."""
    return Shard(dim, tuple((offset + start * unit, offset + stop * unit) for offset, unit, start, stop in blocks),
                 full_size)


def set_shard(param: nn.Parameter | torch.Tensor, shard: Shard | None) -> None:
    """Record how `param` is cut from its checkpoint tensor (None, or a cut that takes the
    whole tensor: replicated, loaded as it is)."""
    param.shard = None if shard is None or shard.is_whole else shard


def shard_of(param: torch.Tensor) -> Shard | None:
    """The cut recorded by `set_shard`, or None for a whole (replicated) tensor."""
    return getattr(param, "shard", None)


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a tensor-parallel group and the collectives over it.

    `group`: the torch.distributed group of the model's collectives (NCCL on CUDA, gloo on
    CPU); None with world size 1. `expert_parallel`: MoE layers hold whole experts per rank
    instead of a slice of every expert.
    """

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` items split evenly (n divisible by the world size)."""
        if n % self.world_size:
            raise ValueError(f"{n} items do not split evenly over {self.world_size} ranks")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def shard(self, dim: int, n: int, pieces: tuple[int, ...] = (0,), unit: int = 1) -> Shard:
        """The cut of a tensor whose dim `dim` holds `len(pieces)` blocks starting at the
        offsets `pieces`, each of `n` items of `unit` rows: this rank takes its even share
        of items from every block (a fused projection such as gate | up)."""
        start, stop = self.split(n)
        return block_shard(dim, max(pieces) + n * unit, ((p, unit, start, stop) for p in pieces))

    def split_or_replicate(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` items that are split when the world size divides
        n, else (n divides the world size) replicated: each rank keeps the one item its even
        share of anything split N ways maps to (KV heads, Mamba groups)."""
        if n % self.world_size == 0:
            return self.split(n)
        if self.world_size % n:
            raise ValueError(f"{n} items can be neither split nor replicated over {self.world_size} ranks")
        item = self.rank * n // self.world_size
        return item, item + 1

    def padded_shard(self, n: int) -> Shard:
        """Rows [r * ceil(n / N), (r + 1) * ceil(n / N)) of a dim-0 of `n` rows that need not
        divide by the world size (a vocabulary); the last rank's rows past n are zeros."""
        per_rank = -(-n // self.world_size)
        return Shard(0, ((self.rank * per_rank, (self.rank + 1) * per_rank),), n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        if dim in (0, -x.ndim):
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)


SINGLE = ParallelContext()


class ColumnParallelLinear(nn.Linear):
    """A linear layer holding the output rows `shard` (dim 0) of the full one, bias alike;
    its output is this rank's slice of the full output (no collective). Runs `ops.linear`."""

    def __init__(self, in_features: int, shard: Shard, bias: bool = False, *, ops: KernelOps):
        super().__init__(in_features, shard.local_size, bias=bias)
        self.ops = ops
        set_shard(self.weight, shard)
        if self.bias is not None:
            set_shard(self.bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """A linear layer holding this rank's even share of the input columns; its output is
    summed over the ranks, the bias added once after the sum. Runs `ops.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, ops: KernelOps,
                 tp: ParallelContext = SINGLE):
        start, stop = tp.split(in_features)
        super().__init__(stop - start, out_features, bias=bias)
        self.ops, self.tp = ops, tp
        set_shard(self.weight, tp.shard(1, in_features))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's unreduced share of the output (no bias): a block that sums several
        partial results reduces them once with `reduce`."""
        return self.ops.linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The full output from the ranks' partial sums: all_reduce, then the bias."""
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return self.ops.linear(x, self.weight, self.bias)  # world size 1: bias inside the GEMM
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings with the vocabulary rows split over the ranks (`padded_shard`): a
    rank looks up the ids in its rows, zeros elsewhere, and the ranks' rows are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: ParallelContext = SINGLE):
        shard = tp.padded_shard(num_embeddings)
        super().__init__(shard.local_size, embedding_dim)
        self.tp, self.vocab_start = tp, shard.ranges[0][0]
        set_shard(self.weight, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[..., None], 0.0))


class ParallelLMHead(nn.Linear):
    """The LM head with the vocabulary rows split like `VocabParallelEmbedding` (so tied
    embeddings share one shard); returns the full [rows, vocab] logits on every rank. Runs
    `ops.linear`."""

    def __init__(self, hidden_size: int, vocab_size: int, *, ops: KernelOps, tp: ParallelContext = SINGLE):
        shard = tp.padded_shard(vocab_size)
        super().__init__(hidden_size, shard.local_size, bias=False)
        self.ops, self.tp, self.vocab_size = ops, tp, vocab_size
        set_shard(self.weight, shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.weight)
        if not self.tp.is_parallel:
            return logits
        # Contiguous rows past the last rank's padding (a no-op when the vocabulary divides).
        return self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size].contiguous()
