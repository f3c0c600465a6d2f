"""The input embedding and the output head of a ZeRO-3 model computed from the ranks' partitions,
a block of vocabulary rows at a time, never gathered whole (issue #16).

Why: DeepSpeed gathers a module's whole weight on every rank for its forward (and the head's again
for its backward). Qwen3-30B-A3B's ``embed_tokens`` and ``lm_head`` are 151,936 x 2048 (0.58 GiB in
bf16 each): gathered, each is the largest tensor a rank holds during a step, twice under gloo (its
all-gather writes a flat copy first). On the 2-layer width rehearsal both ranks' step peaks were
~1.1 GiB above what they hold between steps, for that alone. Here a rank holds one block of rows
(<= ``block_bytes``, 64 MiB by default: `qatlib.zero3.io.PARTITION_BYTES`, the size above which the
load and the save never hold a tensor whole either): the block is assembled by broadcasts from the
ranks whose partitions hold its elements, used, and dropped. Every rank receives the same bytes as
DeepSpeed's gather would bring; the memory is one block.

QAT never quantizes nor trains these two: the embedding needs no backward, and the head's backward
is its input gradient alone, ``sum over blocks of grad[:, block] @ W[block]`` (the blocks broadcast
again). A head or embedding that trains, has a bias, is quantized, or is not a plain
``nn.Embedding`` / ``nn.Linear`` is left to DeepSpeed.

Why the swap happens after ``deepspeed.initialize``: DeepSpeed hooks every module present at
initialisation and gathers a module's weight when it is called; it also gathers any partitioned
parameter read from a module's ``_parameters`` inside a forward (the engine converts modules added
later too). `partition_vocab` puts NEW modules in the model, registering the SAME Parameter objects
(so ZeRO-3 partitions, ties and state-dict keys are unchanged), once the engine exists, and their
forwards reach the weight through a plain reference (`_Partitioned.partitioned`), never through
``_parameters``: DeepSpeed never sees them run. The returned function puts the original modules
back. DeepSpeed has no option to leave a module's weight partitioned through its forward, hence
this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..device import collective_device
from ..surgery.frozen_linear import FrozenLinear, linear_output
from .io import PARTITION_BYTES, get_rank, sliced_evenly


def block_rows(weight: torch.Tensor, block_bytes: int) -> int:
    """Rows of a ``[vocab, hidden]`` weight per block: the most that fit in ``block_bytes``."""
    return max(1, block_bytes // (weight.ds_shape[1] * weight.element_size()))


def _blocks(vocab: int, rows: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, vocab, rows):
        yield lo, min(vocab, lo + rows)


def gather_rows(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a ZeRO-3 ``[vocab, hidden]`` weight on every rank (every rank must call
    it with the same rows). Rank r holds the flat elements ``[r * n, (r + 1) * n)``
    (`qatlib.zero3.io.sliced_evenly`); each rank whose slice meets the rows broadcasts its part."""
    hidden, n = weight.ds_shape[1], weight.ds_tensor.numel()
    a, b = lo * hidden, hi * hidden
    buf = torch.empty(b - a, dtype=weight.dtype, device=collective_device())
    me, local = get_rank(), weight.ds_tensor.detach().view(-1)
    for r in range(a // n, (b - 1) // n + 1):
        s, e = max(a, r * n), min(b, (r + 1) * n)
        piece = buf[s - a : e - a]
        if r == me:
            piece.copy_(local[s - r * n : e - r * n])
        torch.distributed.broadcast(piece, src=r)
    return buf.view(hi - lo, hidden)


def _token_slices(tokens: int, width: int, block_bytes: int) -> Iterator[slice]:
    """Token ranges whose ``[tokens, width]`` fp32 temporaries stay within ``block_bytes``."""
    step = max(1, block_bytes // (4 * max(width, 1)))
    for t in range(0, tokens, step):
        yield slice(t, min(tokens, t + step))


class _Partitioned(nn.Module):
    """Registers ``weight`` (the state-dict key, the tie) and keeps a plain reference to it: reading
    ``self.weight`` inside a DeepSpeed forward would gather it (the module docstring)."""

    def __init__(self, weight: nn.Parameter, block_bytes: int) -> None:
        super().__init__()
        self.weight = weight
        self._ref = [weight]  # a list: not registered, not looked up through ``_parameters``
        self.block_bytes = block_bytes
        self.rows = block_rows(weight, block_bytes)

    @property
    def partitioned(self) -> torch.Tensor:
        return self._ref[0]


class PartitionedEmbedding(_Partitioned):
    """``nn.Embedding``'s lookup (frozen weight) from the ZeRO-3 partitions, a block of rows at a
    time. ``output_requires_grad``: mark the output as requiring grad (what transformers'
    ``enable_input_require_grads`` hooks onto the input embeddings; reentrant checkpointing needs
    it, and the original module's hook does not move with the weight)."""

    def __init__(self, emb: nn.Embedding, block_bytes: int, output_requires_grad: bool) -> None:
        super().__init__(emb.weight, block_bytes)
        self.num_embeddings, self.embedding_dim = tuple(emb.weight.ds_shape)
        self.padding_idx = emb.padding_idx
        self.output_requires_grad = output_requires_grad

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids outside [0, {self.num_embeddings}) in the embedding lookup")
        weight = self.partitioned
        out = torch.zeros(flat.numel(), self.embedding_dim, dtype=weight.dtype, device=ids.device)
        for lo, hi in _blocks(self.num_embeddings, self.rows):
            w = gather_rows(weight, lo, hi).to(ids.device)
            inside = ((flat >= lo) & (flat < hi)).unsqueeze(1)
            out = torch.where(inside, w[(flat - lo).clamp(0, hi - lo - 1)], out)  # no host sync
        out = out.view(*ids.shape, self.embedding_dim)
        return out.requires_grad_(True) if self.output_requires_grad else out


class _PartitionedLinear(torch.autograd.Function):
    """``x @ W.t()`` block by block of W's rows, and its input gradient block by block (W is frozen:
    nothing of it is saved for backward; the blocks are broadcast again)."""

    @staticmethod
    def forward(ctx, x, head):
        ctx.head = head
        w_all, rows, bb = head.partitioned, head.rows, head.block_bytes
        x2 = x.reshape(-1, x.shape[-1])
        out = x.new_empty(x2.shape[0], head.out_features)
        for lo, hi in _blocks(head.out_features, rows):
            w = gather_rows(w_all, lo, hi).to(x.device)
            for t in _token_slices(x2.shape[0], hi - lo, bb):
                out[t, lo:hi] = linear_output(x2[t], w)
        return out.view(*x.shape[:-1], head.out_features)

    @staticmethod
    def backward(ctx, g):
        head = ctx.head
        g2 = g.reshape(-1, g.shape[-1])
        acc = torch.zeros(g2.shape[0], head.in_features, dtype=torch.float32, device=g.device)
        # every block's product in fp32, rounded once at the end, as one GEMM over the whole head
        # would: rounding each block's product to bf16 instead moved the 2-layer rehearsal's first
        # grad norm by 0.35% (the head's input gradient 2.3e-3 from exact instead of autograd's
        # 1.7e-3). fp32 rows in sub-blocks of at most ``block_bytes``; fp32 is also what runs fast
        # where bf16 GEMMs are slow (`qatlib.surgery.frozen_linear`)
        sub = max(1, head.block_bytes // (4 * head.in_features))
        for lo, hi in _blocks(head.out_features, head.rows):
            w = gather_rows(head.partitioned, lo, hi).to(g.device)
            for a, b in _blocks(hi - lo, sub):
                wf = w[a:b].float()
                for t in _token_slices(g2.shape[0], b - a, head.block_bytes):
                    acc[t].addmm_(g2[t, lo + a : lo + b].float(), wf)
        return acc.to(g.dtype).view(*g.shape[:-1], head.in_features), None


class PartitionedHead(_Partitioned):
    """A frozen, bias-free output head computed from the ZeRO-3 partitions (`_PartitionedLinear`)."""

    def __init__(self, head: nn.Linear, block_bytes: int) -> None:
        super().__init__(head.weight, block_bytes)
        self.out_features, self.in_features = tuple(head.weight.ds_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PartitionedLinear.apply(x, self)


def _eligible(m: nn.Module | None, types: tuple[type, ...], block_bytes: int) -> bool:
    """A plain frozen module whose one weight is a ZeRO-3 partition larger than a block."""
    if m is None or type(m) not in types or getattr(m, "bias", None) is not None:
        return False
    w = m.weight
    if w.requires_grad or not sliced_evenly(w) or len(w.ds_shape) != 2 or getattr(w, "ds_persist", False):
        return False
    if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.sparse or m.scale_grad_by_freq):
        return False
    return w.ds_numel * w.element_size() > block_bytes


def partition_vocab(
    model: nn.Module, *, block_bytes: int = PARTITION_BYTES, output_requires_grad: bool = False
) -> tuple[list[str], Callable[[], None]]:
    """Swap the model's input embedding and output head for `PartitionedEmbedding` /
    `PartitionedHead` where eligible (see the module docstring; call it after the DeepSpeed engine
    wraps the model, on every rank). Returns which were swapped (``"input"``, ``"output"``) and the
    function that puts the originals back."""
    swapped: list[str] = []
    undo: list[Callable[[], None]] = []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if _eligible(emb, (nn.Embedding,), block_bytes):
        model.set_input_embeddings(PartitionedEmbedding(emb, block_bytes, output_requires_grad))
        swapped.append("input")
        undo.append(lambda: model.set_input_embeddings(emb))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if _eligible(head, (nn.Linear, FrozenLinear), block_bytes):
        model.set_output_embeddings(PartitionedHead(head, block_bytes))
        swapped.append("output")
        undo.append(lambda: model.set_output_embeddings(head))

    def restore() -> None:
        while undo:
            undo.pop()()

    return swapped, restore
