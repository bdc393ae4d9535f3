"""Transformers ``generate`` as a benchmark peer: requests in order, in batches with left padding.

Only each request's own ``max_tokens`` count (a batch runs to its longest request). Shared by
``bench_engine.py`` (CPU) and ``bench_cuda.py`` (GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from workloads import BenchRequest


def batched_generate(
    model: Any, batch_size: int, device: str = "cpu", pad_id: int = 0
) -> Callable[[list[BenchRequest]], tuple[float, int]]:
    """A workload runner over ``model``: returns (seconds, useful output tokens)."""
    import torch

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        start = time.perf_counter()
        produced = 0
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                n = len(r.prompt_token_ids)
                ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - n :] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                out = model.generate(
                    ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=pad_id,
                )
            produced += sum(min(r.max_tokens, out.shape[1] - width) for r in batch)
        return time.perf_counter() - start, produced

    return run
