"""A CUDA graph of a decode pool's whole step (``BlendConfig.cuda_graphs``; CUDA only).

A decode step of a 7B model launches several hundred small kernels; replayed from a CUDA
graph they cost one launch of host time. The graph records a step (the pool's
:meth:`~ragblend.decode.pool.DecodePool.forward`) over **every** slot of the pool with static
input buffers (tokens, positions): a replay copies the step's tokens and positions into them,
the slots not stepping get position ``capacity`` (the pool's spare column, where their K/V
write lands unread) and the graph's logits rows of the stepping slots are returned. The same
layers run as eagerly (one logic, recorded), so a replay equals
:meth:`~ragblend.decode.pool.DecodePool.forward` over all slots.

Off by default until a GPU run of ``benchmarks/gpu_check.sh`` has checked it
(``tests/test_gpu_paths.py`` compares replays with eager steps); a capture that fails falls
back to eager steps with one warning (:meth:`DecodePool.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A pool's step over all its slots: tokens, positions, rows [slots] int64 → fp32 logits."""


class DecodeGraph:
    """The recorded ``step`` of a pool of ``slots`` slots of ``capacity`` tokens on ``device``
    (a step over every slot; position ``capacity`` is the spare column idle slots write)."""

    def __init__(
        self, step: Step, slots: int, capacity: int, device: torch.device, warmup: int = 2
    ) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the pool is on {device}")
        self.slots, self.capacity = slots, capacity
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        # idle rows write the spare column (the recording and warmup write only there)
        self.positions = torch.full((slots,), capacity, dtype=torch.long, device=device)
        self.rows = torch.arange(slots, device=device)

        def run() -> torch.Tensor:
            return step(self.tokens, self.positions, self.rows)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # allocations and lazy inits outside the recording
            for _ in range(warmup):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()

    def replay(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
    ) -> torch.Tensor:
        """fp32 logits [B, vocab] of the requests in ``slots`` fed ``tokens`` at
        ``positions`` (their K/V rows written into the pool, as an eager step writes them)."""
        ids = torch.zeros(self.slots, dtype=torch.long)
        at = torch.full((self.slots,), self.capacity, dtype=torch.long)
        index = torch.tensor(list(slots))
        ids[index] = torch.tensor(list(tokens))
        at[index] = torch.tensor(list(positions))
        self.tokens.copy_(ids)
        self.positions.copy_(at)
        self.graph.replay()
        return self.logits.index_select(0, index.to(self.logits.device))
