"""A whole training step (forward, backward, optimizer step) captured once as a CUDA graph and then replayed.

Why: a replay launches every kernel of the step in one call, so the GPU never waits for Python. The profile of
issue 6 found Qwen2.5-1.5B (28 layers, 1536 wide) idle ~30 ms of a ~320 ms step waiting for the host; models with
fat layers lose little, thin ones a lot.

How (the whole-network recipe of PyTorch's CUDA-graph notes):
1. The first ``warmup`` calls run the step eagerly on a side stream: Triton compiles, cuBLAS/cuDNN pick their
   kernels and workspaces, the optimizer creates its state. They are ordinary training steps.
2. The next call captures the step into a graph with the parameters' gradients set to None, so the captured
   backward writes fresh gradients (not accumulates) and the captured optimizer step consumes them; then replays it.
3. Every later call copies the batch into the static input buffers and replays.
A replay reruns the captured kernels on the same addresses: it computes what the eager step computes (bit for bit
where the kernels are deterministic; tests/train/test_cuda_graph.py checks that on SDPA's math backend).

What the step must be (checked where it can be):
- Fixed shapes: every batch has the example's shapes and dtypes (pack to a fixed length).
- No host sync: nothing may read a device value on the host inside the step. The loss kernels' label range check
  ends in one such read; while capturing only its device part is recorded (the loss kernels still do nothing on a
  bad label), so ``GraphedStep`` runs the whole check on each batch as it is copied in (``label_keys``), where a
  bad label still raises the same ValueError before any kernel reads with it.
- A capturable optimizer: ``FusedAdamW(..., capturable=True)`` (optim.py) or ``torch.optim.AdamW(..., fused=True,
  capturable=True)`` (the step count lives on the GPU).
  A float learning rate would be baked into the graph, so just before the capture each group's float ``lr``
  becomes a 0-dim tensor on its parameters' device; an LR scheduler then fills it in place (torch's schedulers
  do) and every replay reads the current value. ``float(group["lr"])`` reads it back.
- The returned tensors are the graph's static outputs: the next replay overwrites them; clone what you keep.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from liger_models.kernels.ops.cross_entropy import check_labels  # the loss kernels' own range check


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("capturable", False) for group in optimizer.param_groups)


class GraphedStep:
    """``step(batch)`` run eagerly ``warmup`` times, then captured and replayed.

    step: (dict of static CUDA tensors) → any pytree of tensors; it does the forward, the backward and
    ``optimizer.step()``. optimizer: the one the step uses (its gradients are cleared before the capture).
    label_keys: batch entries holding labels as {key: (vocab_size, ignore_index)}, range-checked on copy-in.
    """

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], Any], optimizer: torch.optim.Optimizer, *,
                 warmup: int = 3, label_keys: dict[str, tuple[int, int]] | None = None) -> None:
        if warmup < 1:
            raise ValueError("warmup must be ≥ 1: the optimizer's state must exist before the capture")
        if not _capturable(optimizer):
            raise ValueError("the optimizer must be built with capturable=True (e.g. torch.optim.AdamW(..., "
                             "fused=True, capturable=True)); otherwise its step count is read on the host")
        self.step_fn, self.optimizer, self.warmup = step, optimizer, warmup
        self.label_keys = dict(label_keys or {})
        self.calls = 0
        self.inputs: dict[str, torch.Tensor] | None = None
        self.outputs = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self._side = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _copy_in(self, batch: dict[str, torch.Tensor]) -> None:
        for key, (vocab_size, ignore_index) in self.label_keys.items():
            check_labels(batch[key], vocab_size, ignore_index)
        if self.inputs is None:
            bad = [k for k, v in batch.items() if not v.is_cuda]
            if bad:
                raise ValueError(f"GraphedStep needs CUDA tensors; {bad} are not")
            self.inputs = {k: v.clone() for k, v in batch.items()}
            return
        if batch.keys() != self.inputs.keys():
            raise ValueError(f"batch keys {sorted(batch)} differ from the captured {sorted(self.inputs)}")
        for k, v in batch.items():
            static = self.inputs[k]
            if v.shape != static.shape or v.dtype != static.dtype:
                raise ValueError(f"batch[{k!r}] is {tuple(v.shape)} {v.dtype}; the graph was captured for "
                                 f"{tuple(static.shape)} {static.dtype} (a CUDA graph replays fixed shapes)")
            static.copy_(v, non_blocking=True)

    def __call__(self, batch: dict[str, torch.Tensor]):
        self._copy_in(batch)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if self._side is None:
            self._side = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)
        if self.calls <= self.warmup:
            with torch.cuda.stream(self._side):
                out = self.step_fn(self.inputs)
            current.wait_stream(self._side)
            return out
        # Capture. Gradients must not exist yet: the captured backward then allocates and writes them, rather
        # than adding into tensors from an eager step, and every replay produces this step's gradients afresh.
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=group["params"][0].device)
        current.wait_stream(self._side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self.step_fn(self.inputs)
        self.graph = graph
        graph.replay()  # capturing records the kernels without running them
        return self.outputs
