"""PyTorch's side of a model: exporting a ``torch.nn.Module`` to ONNX as users do
(``export``), torchvision's model definitions beside the CPU torch (``torchvision_models``),
and the check of the executor's gradients against the module's own autograd
(``reference``)."""
