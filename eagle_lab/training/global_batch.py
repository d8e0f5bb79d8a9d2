"""One optimizer step over a global batch, normalised by the global batch's supervised positions.

A global batch is `grad_accum` micro-batches on each of `world` ranks. Averaging each micro-batch's
loss on its own (then DeepSpeed's 1/grad_accum and the ranks' gradient mean) weights a token by
how full its micro-batch happens to be, so the gradient would depend on how the batch is split.
Here every micro-batch's loss is its share of the global average (its sum over the global count),
scaled back by world x grad_accum before DeepSpeed divides: one rank with micro-batch 4 and two
ranks with micro-batch 2 take the same step, and log the same loss.
"""

from __future__ import annotations

import torch

from eagle_lab.training.losses import Batch, LossConfig, supervised_positions, training_loss


def summed_over_ranks(values: torch.Tensor, world: int, device: torch.device) -> torch.Tensor:
    """values summed over the ranks (a collective when world > 1: every rank calls it), on values' own device;
    reduced on `device`, the training device (nccl reduces device tensors only)."""
    if world == 1:
        return values
    summed = values.to(device, copy=True)
    torch.distributed.all_reduce(summed)
    return summed.to(values.device)


def global_batch_step(engine, target, target_rows: torch.Tensor, batches: list[Batch], loss_cfg: LossConfig,
                      steps: int, world: int, autocast) -> tuple[float, dict[str, float]]:
    """Backward and step over this rank's micro-batches -> (global loss, global metrics)."""
    head = engine.module
    local = sum(supervised_positions(head, target, batch, loss_cfg, steps) for batch in batches)  # [steps]
    denominators = summed_over_ranks(local, world, target_rows.device)
    scale = world * len(batches)  # undoes DeepSpeed's 1/grad_accum and the ranks' gradient mean
    loss_sum, metric_sums = 0.0, {}
    for batch in batches:
        with autocast():
            loss, metrics = training_loss(head, target, target_rows, batch, loss_cfg, steps, denominators)
        engine.backward(loss * scale)
        engine.step()
        loss_sum += float(loss.detach())
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value
    names = sorted(metric_sums)
    sums = torch.tensor([loss_sum, *(metric_sums[n] for n in names)], dtype=torch.float64)
    totals = summed_over_ranks(sums, world, target_rows.device)
    return float(totals[0]), dict(zip(names, totals[1:].tolist()))
