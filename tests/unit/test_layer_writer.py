"""The GPTQ/AWQ runner's background writer (kq.quantize.layerwise._LayerWriter): a layer's work files are
written on another thread while the caller goes on; a failed write is raised by wait() and leaves no file."""
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kq.quantize.layerwise as lw


def test_a_write_runs_on_another_thread_while_the_caller_goes_on_one_layer_at_a_time(tmp_path, monkeypatch):
    gate, writers = threading.Event(), []
    real = lw._atomic_save

    def gated(tensors, path):   # the real atomic write, once the test lets it go
        writers.append(threading.current_thread())
        assert gate.wait(60), "the caller never went on: the write ran on its thread"
        real(tensors, path)
    monkeypatch.setattr(lw, "_atomic_save", gated)
    a, b = tmp_path / "acts-0001.safetensors", tmp_path / "layer-0000.safetensors"
    ta, tb = {"h.0": torch.randn(3, 4)}, {"x.packed": torch.arange(8, dtype=torch.int32).view(2, 4)}
    with lw._LayerWriter() as w:
        w.submit({a: ta, b: tb})
        assert not a.exists() and not b.exists()   # submit returned with the write still held at the gate
        gate.set()
        w.wait()
        assert torch.equal(load_file(str(a))["h.0"], ta["h.0"])
        assert torch.equal(load_file(str(b))["x.packed"], tb["x.packed"])
        assert writers and all(t is not threading.current_thread() for t in writers)
        # at most one layer's files in flight: the next submit returns only after the previous write ended
        gate.clear()
        c, d = tmp_path / "acts-0002.safetensors", tmp_path / "layer-0001.safetensors"
        w.submit({c: ta})
        threading.Timer(0.2, gate.set).start()
        w.submit({d: tb})
        assert c.exists()
        w.wait()
        assert d.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (a, b, c, d))   # no temp files


def test_a_failed_write_is_raised_by_wait_and_leaves_no_file(tmp_path, monkeypatch):
    def disk_full(tensors, filename, metadata=None):   # half a file written, then the disk is full
        Path(filename).write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(lw, "save_file", disk_full)
    path = tmp_path / "layer-0001.safetensors"
    with lw._LayerWriter() as w:
        w.submit({path: {"x": torch.zeros(2)}})
        with pytest.raises(OSError, match="No space left"):
            w.wait()
        w.wait()   # raised once; nothing left in flight
    assert list(tmp_path.iterdir()) == []   # neither the file nor its temp file
