"""tests/scripts/count_syncs.py, the counter of host syncs: calls are counted on every thread, each
with the thread that made it, and the DataLoader's pin-memory thread (host memory only) is told
apart from the rest by its name."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.launch_utils import REPO

SCRIPT = REPO / "tests" / "scripts" / "count_syncs.py"


@pytest.fixture
def counting(monkeypatch):
    """count_syncs.py as a fresh module; what its `install()` patches is put back after the test."""
    from deepspeed.accelerator import get_accelerator

    spec = importlib.util.spec_from_file_location("count_syncs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in module.TENSOR_READS:  # set to itself: monkeypatch restores it after the test
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    monkeypatch.setattr(torch, "tensor", torch.tensor)
    monkeypatch.setattr(torch.cuda, "synchronize", torch.cuda.synchronize)
    monkeypatch.setattr(get_accelerator(), "synchronize", get_accelerator().synchronize)
    return module


def test_a_call_on_another_thread_is_counted_with_that_threads_name(counting):
    """On CUDA the backward, DeepSpeed's gradient hooks with it, runs on autograd's device thread."""
    counting.install()
    worker = threading.Thread(target=lambda: torch.ones(1).item(), name="device-thread")
    worker.start()
    worker.join()
    torch.ones(1).item()
    assert [call["kind"] for call in counting.calls] == ["item", "item"]
    assert [call["thread"] for call in counting.calls] == ["device-thread", "MainThread"]
    assert counting.calls[0]["stack"][-1].startswith("tests/project/test_count_syncs.py:")
    assert not any(counting.on_pin_memory_thread(call) for call in counting.calls)


class _Probe:
    """A batch whose pinning makes a counted call, on the thread the DataLoader pins batches on."""

    def pin_memory(self) -> _Probe:
        torch.ones(1).item()
        return self


class _Probes(Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> _Probe:
        return _Probe()


@pytest.mark.slow
def test_the_pin_memory_thread_is_told_apart_by_its_name(counting, monkeypatch):
    """torch's DataLoader pins batches on a thread of its own (with a GPU; here with torch told there
    is an accelerator), whose calls are the only ones `on_pin_memory_thread` singles out."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    counting.install()
    loader = DataLoader(_Probes(), batch_size=None, num_workers=1, pin_memory=True)
    assert [type(batch) for batch in loader] == [_Probe]
    torch.ones(1).item()
    pinning = [call for call in counting.calls if counting.on_pin_memory_thread(call)]
    where = [(call["kind"], call["stack"][-1].rsplit(":", 1)[1]) for call in pinning]
    assert where == [("item", "pin_memory")]  # the probe's call, and no other
    assert counting.calls[-1]["thread"] == "MainThread" and pinning[0]["thread"] != "MainThread"
