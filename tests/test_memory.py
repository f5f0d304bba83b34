"""Packed weights on transparent huge pages (kernels/memory.py)."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from kernels import cpu_gemm
from kernels.memory import HUGE_PAGE, empty_huge, huge_copy


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ({} where none does)."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                if inside:
                    break
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


@pytest.mark.parametrize("shape, dtype", [((1024, 769), torch.float32), ((3, 1001, 700), torch.bfloat16),
                                          ((5, 524289), torch.int8)], ids=str)
def test_a_large_buffer_starts_on_a_huge_page_and_is_advised(shape, dtype):
    t = empty_huge(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()  # fresh anonymous memory
    t.fill_(3)
    assert (t == 3).all()
    fields = _mapping(t.data_ptr())
    if fields and _thp_mode() in ("madvise", "always"):
        assert "hg" in fields.get("VmFlags", "").split()  # madvise(MADV_HUGEPAGE) took
        assert fields.get("THPeligible", "1") == "1"


def test_a_small_buffer_is_plain_torch_memory():
    t = empty_huge((100, 100), torch.float32)
    assert t.shape == (100, 100) and t.dtype == torch.float32 and t.is_contiguous()
    fields = _mapping(t.data_ptr())
    assert "hg" not in fields.get("VmFlags", "").split()


def test_the_mapping_goes_with_the_last_view():
    t = empty_huge((2 * HUGE_PAGE,), torch.uint8)
    view = t[HUGE_PAGE:]
    address = t.data_ptr()
    del t
    gc.collect()
    view.fill_(1)  # still mapped: the view holds it
    assert _mapping(address)
    del view
    gc.collect()
    fields = _mapping(address)
    assert "hg" not in fields.get("VmFlags", "").split()  # unmapped (or reused by something else)


def test_huge_copy_and_packed_weights():
    w = torch.randn(1100, 512)  # 2.2 MB: over one huge page
    c = huge_copy(w.t())
    assert c.is_contiguous() and c.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(c, w.t())
    p = cpu_gemm.pack(w, 32, torch.float32, pairs=False)
    assert p.data.data_ptr() % HUGE_PAGE == 0
    torch.testing.assert_close(p.unpack(), w, rtol=0, atol=0)


def test_the_last_partial_huge_page_stays_on_small_pages():
    t = empty_huge((HUGE_PAGE + 4096,), torch.uint8)
    t.fill_(1)
    body, tail = _mapping(t.data_ptr()), _mapping(t.data_ptr() + HUGE_PAGE)
    if body and _thp_mode() in ("madvise", "always"):
        assert "hg" in body["VmFlags"].split()
        assert "nh" in tail["VmFlags"].split() and int(tail["Rss"].split()[0]) <= 8  # kB: one small page
