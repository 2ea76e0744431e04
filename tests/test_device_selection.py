"""XPU tiles: each shard picks its own tile and its collective backend, decided from a fake
platform (no XPU is needed): Ray's ZE_AFFINITY_MASK, Ray's GPU id when nothing masks the
tiles, ccl when the oneCCL bindings import and xccl otherwise."""

from __future__ import annotations

import logging

import pytest

from tpserve.cluster.device import accelerator_index, dist_backend, local_cluster_gpus


class FakePlatform:
    def __init__(self, env=None, gpu_ids=(), count=1, modules=(), broken=(), xccl=True):
        self.env, self.gpu_ids, self.count = dict(env or {}), list(gpu_ids), count
        self.modules, self.broken, self.xccl = set(modules), set(broken), xccl

    def ray_gpu_ids(self):
        return self.gpu_ids

    def device_count(self, device):
        return self.count

    def import_module(self, name):
        if name in self.broken:
            raise ImportError(f"libccl.so.1: cannot open shared object file ({name})",
                              name="torch_ccl_core")
        if name not in self.modules:
            raise ImportError(f"No module named {name!r}", name=name)
        return object()

    def xccl_available(self):
        return self.xccl


def test_ray_mask_means_the_only_visible_tile():
    index, why = accelerator_index("xpu", FakePlatform({"ZE_AFFINITY_MASK": "5"}, ["5"], 1))
    assert index == 0 and why == "ZE_AFFINITY_MASK=5"
    index, why = accelerator_index(
        "xpu", FakePlatform({"ONEAPI_DEVICE_SELECTOR": "level_zero:3"}, [], 1))
    assert index == 0 and "ONEAPI_DEVICE_SELECTOR=level_zero:3" in why


def test_mask_with_several_tiles_warns(caplog):
    with caplog.at_level(logging.WARNING):
        index, _ = accelerator_index("xpu", FakePlatform({"ZE_AFFINITY_MASK": "0,1"}, [], 2))
    assert index == 0 and "leaves 2 XPU devices visible" in caplog.text


def test_unmasked_tiles_follow_rays_gpu_id():
    # Ray without dpctl: the GPU resource is assigned, but every tile stays visible.
    assert accelerator_index("xpu", FakePlatform({}, ["3"], 8))[0] == 3
    assert accelerator_index("xpu", FakePlatform({}, ["0"], 8))[0] == 0
    with pytest.raises(RuntimeError, match="assigned GPU 4 .* only 2 XPU"):
        accelerator_index("xpu", FakePlatform({}, ["4"], 2))
    assert accelerator_index("xpu", FakePlatform({}, [], 8)) == (
        0, "no Ray GPU assignment and no device mask: the first device")


def test_cuda_is_always_index_zero():
    # Ray sets CUDA_VISIBLE_DEVICES to the one GPU; its id is not an index any more.
    index, why = accelerator_index("cuda", FakePlatform({"CUDA_VISIBLE_DEVICES": "6"}, ["6"], 1))
    assert index == 0 and why == "CUDA_VISIBLE_DEVICES=6"


def test_collective_backend_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tpserve.cluster.device"):
        assert dist_backend("xpu", FakePlatform(modules={"oneccl_bindings_for_pytorch"})) == "ccl"
        assert "ccl (oneccl_bindings_for_pytorch imported)" in caplog.text
        caplog.clear()
        assert dist_backend("xpu", FakePlatform()) == "xccl"
        assert "xccl (built into PyTorch; oneccl_bindings_for_pytorch is not installed)" in (
            caplog.text)
        caplog.clear()
        # Installed but broken bindings fall back to xccl and say why.
        assert dist_backend("xpu", FakePlatform(broken={"oneccl_bindings_for_pytorch"})) == "xccl"
        assert "does not import: libccl.so.1" in caplog.text
    with pytest.raises(RuntimeError, match="no collective backend for XPU.*PyTorch >= 2.8"):
        dist_backend("xpu", FakePlatform(xccl=False))
    assert dist_backend("cuda", FakePlatform()) == "nccl"
    assert dist_backend("cpu", FakePlatform()) == "gloo"


def test_local_cluster_declares_gpus_only_for_xpu():
    assert local_cluster_gpus("cpu") is None and local_cluster_gpus("cuda") is None
