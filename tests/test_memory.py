"""Packed weights on transparent huge pages (kernels/memory.py)."""

from __future__ import annotations

import gc
import mmap
import os
import re

import pytest
import torch

from moemesh_kernels import cpu_gemm
from moemesh_kernels.memory import HUGE_PAGE, empty_huge, huge_copy, use_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                                reason="no MADV_HUGEPAGE or /proc/self/smaps: empty_huge is torch.empty here")


def _mapping(address: int) -> tuple[tuple[int, int] | None, dict[str, str]]:
    """The range and /proc/self/smaps fields of the mapping that holds address ((None, {}) where none does)."""
    fields: dict[str, str] = {}
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                if span:
                    break
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                span = (lo, hi) if lo <= address < hi else None
            elif span:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return span, fields


def _ranges() -> set[tuple[int, int]]:
    with open("/proc/self/maps") as f:
        return {tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f}


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


THP = _thp_mode() in ("madvise", "always")


@pytest.mark.parametrize("shape, dtype", [((1024, 769), torch.float32), ((3, 1001, 700), torch.bfloat16),
                                          ((5, 524289), torch.int8), ((HUGE_PAGE,), torch.uint8),
                                          ((2, HUGE_PAGE // 4), torch.float32)], ids=str)
def test_a_large_buffer_starts_on_a_huge_page_and_is_advised(shape, dtype):
    t = empty_huge(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()  # fresh anonymous memory
    t.fill_(3)
    assert (t == 3).all()
    _, body = _mapping(t.data_ptr())
    _, last = _mapping(t.data_ptr() + t.numel() * t.element_size() - 1)
    if THP:
        assert "hg" in body["VmFlags"].split()  # madvise(MADV_HUGEPAGE) took
        whole = t.numel() * t.element_size() % HUGE_PAGE == 0
        assert ("hg" in last["VmFlags"].split()) == whole  # (a partial last huge page: small pages)


def test_a_buffer_under_one_huge_page_is_plain_torch_memory():
    for n in (100, HUGE_PAGE - 1):
        t = empty_huge((n,), torch.uint8)
        assert t.shape == (n,) and t.is_contiguous()
        assert "hg" not in _mapping(t.data_ptr())[1].get("VmFlags", "").split()


def test_the_mapping_goes_with_the_last_view():
    t = empty_huge((2 * HUGE_PAGE,), torch.uint8)
    view = t[HUGE_PAGE:]
    span, _ = _mapping(t.data_ptr())
    assert span in _ranges()
    del t
    gc.collect()
    view.fill_(1)  # still mapped: the view holds it
    assert span in _ranges()
    del view
    gc.collect()
    assert span not in _ranges()


def test_the_last_partial_huge_page_stays_on_small_pages():
    t = empty_huge((HUGE_PAGE + 4096,), torch.uint8)
    t.fill_(1)
    _, body = _mapping(t.data_ptr())
    _, tail = _mapping(t.data_ptr() + HUGE_PAGE)
    if THP:
        assert "hg" in body["VmFlags"].split()
        assert "nh" in tail["VmFlags"].split() and int(tail["Rss"].split()[0]) <= 8  # kB: one small page


def test_huge_copy_and_packed_weights():
    w = torch.randn(1100, 512)  # 2.2 MB: over one huge page
    c = huge_copy(w.t())
    assert c.is_contiguous() and c.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(c, w.t())
    p = cpu_gemm.pack(w, 32, torch.float32, pairs=False)
    assert p.data.data_ptr() % HUGE_PAGE == 0
    torch.testing.assert_close(p.unpack(), w, rtol=0, atol=0)


@pytest.mark.skipif(cpu_gemm.native() is None, reason="no C compiler: no native kernels, no screened head")
def test_the_screened_heads_copies_are_huge_and_exact():
    lib = cpu_gemm.native()
    w = torch.randn(9000, 256) * 0.05  # copies of 2.3 MB (int8) and 4.6 MB (bfloat16): over one huge page
    for wt in (torch.float32, torch.bfloat16):
        head = cpu_gemm.pack(w, lib.panel_width, wt)
        screen = cpu_gemm.ScreenedHead(head, 9000, lib)
        assert screen.copy.data.data_ptr() % HUGE_PAGE == 0
        if wt == torch.float32:  # the bfloat16 copy: pack's rounding, panel for panel
            torch.testing.assert_close(screen.copy.unpack(), w.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.skipif(cpu_gemm.native() is None, reason="no C compiler: no packed weights")
@pytest.mark.parametrize("off", [False, True], ids=["huge pages", "--no-huge-pages"])
def test_no_huge_pages_keeps_an_engines_weights_on_small_pages(tmp_path, off):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
    from moemesh.settings import EngineSettings

    model = write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=256, intermediate_size=1024,
                                           num_experts=4, vocab_size=384), tmp_path / "model")  # w13: 8 MB
    try:
        engine = LLMEngine(EngineSettings(model=str(model), no_huge_pages=off), progress=False)
        (moe,) = [m for m in engine.stages[0].runner.model.modules() if isinstance(getattr(m, "packed", None), tuple)]
        w13 = moe.packed[0].data
        advised = "hg" in _mapping(w13.data_ptr())[1].get("VmFlags", "").split()
        if not off:
            assert w13.data_ptr() % HUGE_PAGE == 0
        if THP:
            assert advised == (not off)
    finally:
        use_huge_pages(True)  # (process-wide: the tests after this one ask again)
