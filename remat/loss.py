"""The training loss a job differentiates: what the loss node of the training graph
computes from the model's outputs.

* ``mean_square`` (the default): ``L = sum over float model outputs y of 0.5 * mean(y**2)``,
  a loss every model has, so that any model can be planned and checked.
* ``cross_entropy``: ``L = mean over positions of -log softmax(y)[label]`` for one output
  ``y`` of logits, classes along ``axis`` (default the last: classifier logits ``(N, C)``
  and a language model's ``(N, T, V)``; 1 for a segmentation map ``(N, C, H, W)``). The
  labels are a fixed int64 tensor of ``y``'s shape without ``axis``, named
  ``labels_name(output)``: given with the model inputs, else drawn from the run's seed.
* ``output``: ``L = y`` for one scalar output ``y`` that is already the model's loss (a
  model exported with its loss, e.g. a Hugging Face model given its labels).

``output`` names the model output the loss reads (``cross_entropy`` and ``output``;
default the first float output of the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LossKind(StrEnum):
    MEAN_SQUARE = "mean_square"
    CROSS_ENTROPY = "cross_entropy"
    OUTPUT = "output"


@dataclass(frozen=True)
class Loss:
    kind: LossKind = LossKind.MEAN_SQUARE
    output: str | None = None  # the model output read (not for mean_square)
    axis: int = -1  # cross_entropy: the class axis of the logits

    def describe(self) -> str:
        """The loss in one phrase, as reports print it."""
        if self.kind is LossKind.MEAN_SQUARE:
            return "0.5 mean(y^2) over the model outputs"
        if self.kind is LossKind.CROSS_ENTROPY:
            return f"cross-entropy of {self.output!r} (classes on axis {self.axis})"
        return f"the model's own loss output {self.output!r}"


MEAN_SQUARE = Loss()


def labels_name(output: str) -> str:
    """The fixed tensor holding a cross-entropy loss's labels for logits ``output``."""
    return f"{output}:labels"
