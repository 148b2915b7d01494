"""A CPU stage's weights in arenas advised for transparent huge pages (`hugemem`).

tinygrad maps its CPU buffers shared, and Linux gives shared memory 4 KiB pages only, so a weight streamed from DRAM
crossed a page every 4 KiB. These tests read the kernel's own account of the mappings (/proc/self/smaps: ``VmFlags``
has ``hg`` where MADV_HUGEPAGE was given), which holds whatever THP policy the machine has, and run a real stage on
such memory against the same stage in tinygrad's.
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes, nn

from pp_worker.testing.chain import Chain
from pp_worker.testing.devmem import device_memory
from pp_worker.testing.modelgen import generate
from pp_worker.worker import hostio, hugemem

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE and smaps are Linux's")


def _mapping(address: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of this process's mapping holding ``address``, or None."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        if lo <= address < hi:
            flags = re.search(r"^VmFlags:(.*)$", entry, re.M)
            return lo, hi, set(flags.group(1).split()) if flags else set()
    return None


def _address(t: Tensor) -> int:
    return int(hostio.device_buffer(t)._buf.va_addr)


def _weight(n: int, seed: int) -> tuple[Tensor, np.ndarray]:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)

    def fill(mv: memoryview) -> None:
        np.frombuffer(mv, np.float32)[:] = values

    return hostio.filled((n,), dtypes.float32, fill, weight=True), values


def test_weights_sit_one_after_another_in_an_arena_advised_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    hugemem._arena = None  # the next weight starts an arena (any earlier one goes with its last weight)
    monkeypatch.setattr(hugemem, "ARENA", 4 * hugemem.HUGE_PAGE)
    (a, va), (b, vb) = _weight(1000, 0), _weight(3 * hugemem.HUGE_PAGE // 4, 1)  # 4000 bytes, then 6 MiB
    at_a, at_b = _address(a), _address(b)
    assert at_a % hugemem.HUGE_PAGE == 0 and at_b == at_a + hugemem.ALIGN  # the next 4 KiB boundary
    head = _mapping(at_a)
    assert head is not None and "hg" in head[2] and head[0] <= at_a and at_b + vb.nbytes <= head[1]
    assert np.array_equal(a.numpy(), va) and np.array_equal(b.numpy(), vb)
    assert (b * 2).sum().item() == pytest.approx(2 * float(vb.astype(np.float64).sum()), rel=1e-4)
    (c, vc) = _weight(3 * hugemem.HUGE_PAGE // 4, 2)  # 6 MiB more do not fit the 8 MiB arena: a new one
    at_c = _address(c)
    assert at_c % hugemem.HUGE_PAGE == 0 and _mapping(at_c) != head and np.array_equal(c.numpy(), vc)
    del a, b
    gc.collect()
    assert _mapping(at_a) is None and _mapping(at_c) is not None  # an arena goes with its last weight
    del c
    gc.collect()
    assert _mapping(at_c) is None and hugemem._arena is None


@pytest.mark.parametrize("weight", [True, False])
def test_other_tensors_and_other_devices_memory_stay_tinygrads(weight: bool) -> None:
    if weight:  # a device whose memory is not the host's: its weights go through copyin as before
        with device_memory():
            t = hostio.filled((1 << 20,), dtypes.float32, weight=True)
    else:  # a stage's inputs and outputs: written in place through tinygrad's own view
        t = hostio.filled((1 << 20,), dtypes.float32)
        assert hostio.host_view(t) is not None
    assert hostio.device_buffer(t).options is None and t.sum().item() == 0.0


def test_an_arena_the_system_refuses_leaves_the_weight_in_tinygrads_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    hugemem._arena = None
    monkeypatch.setattr(hugemem, "ARENA", 1 << 60)  # more than any address space: mmap fails (ENOMEM), as for a
    t, values = _weight(1000, 3)  # reservation strict overcommit will not commit
    assert hostio.device_buffer(t).options is None and np.array_equal(t.numpy(), values)


def _stage_tensors(chain: Chain) -> list[Tensor]:
    """Every buffer-backed tensor the stages read from the file: their blocks', head's and embedding's (packed
    weights' bytes included; not the fp16 views of bytes, nor the rope table, which is computed)."""
    objs = [o for e in chain.engines for o in (*e._w.blocks, e._w.output, e._w.token_embd) if o is not None]
    return [t for o in objs for name, t in nn.state.get_state_dict(o).items()
            if t.uop.base.realized is not None and name != "freqs_cis"]


@pytest.mark.parametrize("dtype", ["F16", "Q4_K"])  # fp16 rows and a K-quant's packed bytes
def test_a_stage_on_huge_page_memory_computes_the_same_bits_as_on_tinygrads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    model = generate(tmp_path / f"kq-{dtype}.gguf", preset="kq", seed=4, dtype=dtype)
    prompt = [5, 9, 11, 3, 7, 2, 40, 41]
    chain = Chain(model, 2, 64)
    tensors = _stage_tensors(chain)
    assert tensors and all("hg" in (_mapping(_address(t)) or (0, 0, set()))[2] for t in tensors)
    got = chain.generate(1, prompt, 4)
    monkeypatch.setattr(hugemem, "weight", lambda *a: None)  # the same stage in tinygrad's memory
    plain = Chain(model, 2, 64)
    assert all(hostio.device_buffer(t).options is None for t in _stage_tensors(plain))
    want = plain.generate(1, prompt, 4)
    assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1], strict=True))
