"""Make PyPI's torchvision 0.28.0 (built against CUDA torch) importable with CPU torch 2.13.

No CPU build of torchvision is on the reachable index. Its compiled ops (`_C.so`) cannot load
(they link libtorch_cuda), and `torchvision/_meta_registrations.py` then fails at import on
`register_fake("torchvision::nms")` / `("torchvision::qnms")` because those op schemas do not
exist. This meta-path hook defines just those two schemas the first time `torchvision` is
imported, so its pure-Python parts (transforms.v2.functional, which transformers' Qwen-VL
image/video processors import at module level) work. Box ops (nms, roi_align, ...) stay
unusable; nothing on vLLM's Qwen-VL path calls them.
Installed by a .pth file (scripts/tiers/venv.sh: tier_shim_torchvision) so subprocesses get it too (vLLM
inspects model architectures in one). Test tiers only: never installed with the service.
"""
import importlib.abc
import sys

_LIBS = []


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        _LIBS.append(lib)  # a Library's definitions vanish when it is garbage-collected
        for op in ("nms", "qnms"):
            try:
                lib.define(
                    f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass  # already defined (the real extension loaded)
        return None  # let the normal finders import torchvision


def install():
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
