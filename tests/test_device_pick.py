"""tinygrad's device pick remembered per boot (device): written by a stage that let tinygrad pick,
read back by the next, before tinygrad's import; never over the operator's DEV, never from another boot, another
environment or a corrupt file, never with PP_CACHE=0; forgotten by a stage that cannot open it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

from pp_worker.testing.modelgen import generate
from pp_worker.worker import device as device_pick


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PP_CACHE", "1")
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEV", "")  # so that what recall sets is undone, as is this
    monkeypatch.delenv("DEV")
    monkeypatch.delitem(sys.modules, "tinygrad", raising=False)  # as before the engine import
    boot = tmp_path / "boot_id"
    boot.write_text("a-boot\n")
    monkeypatch.setattr(device_pick, "BOOT_ID", boot)
    return tmp_path


def test_a_pick_written_down_is_read_back_before_tinygrad_is_imported(cache: Path) -> None:
    assert not device_pick.recall()  # nothing remembered yet: tinygrad picks
    device_pick.remember("CPU")
    assert json.loads((cache / "device.json").read_text())["device"] == "CPU"
    assert device_pick.recall() and os.environ["DEV"] == "CPU"


def test_the_operators_dev_wins(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device_pick.remember("CPU")
    monkeypatch.setenv("DEV", "NULL")
    assert not device_pick.recall() and os.environ["DEV"] == "NULL"


def test_another_boot_or_environment_picks_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device_pick.remember("CPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a device made visible
    assert not device_pick.recall() and "DEV" not in os.environ
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (cache / "boot_id").write_text("another-boot\n")
    assert not device_pick.recall() and "DEV" not in os.environ


@pytest.mark.parametrize("text", ["", "{", "[]", '{"key": 1}', '{"device": "CPU"}'])
def test_a_corrupt_entry_is_ignored(cache: Path, text: str) -> None:
    (cache / "device.json").write_text(text)
    assert not device_pick.recall() and "DEV" not in os.environ
    device_pick.remember("CPU")  # written again, whole
    assert device_pick.recall()


def test_after_tinygrads_import_or_with_pp_cache_0_nothing_happens(cache: Path, monkeypatch) -> None:
    device_pick.remember("CPU")
    monkeypatch.setitem(sys.modules, "tinygrad", object())  # too late: tinygrad has read DEV already
    assert not device_pick.recall()
    monkeypatch.delitem(sys.modules, "tinygrad")
    monkeypatch.setenv("PP_CACHE", "0")
    (cache / "device.json").unlink()
    device_pick.remember("CPU")
    assert not (cache / "device.json").exists() and not device_pick.recall()


def test_a_remembered_device_that_fails_to_open_is_forgotten(cache: Path, tmp_path: Path, monkeypatch) -> None:
    """A real stage started on a remembered device it cannot open fails to load (exit 2) and drops the entry; the
    next start lets tinygrad pick again, and writes its pick down."""
    monkeypatch.setattr(device_pick, "BOOT_ID", Path("/proc/sys/kernel/random/boot_id"))  # the stages' boot
    if device_pick.key() is None:
        pytest.skip("no Linux boot id here: nothing is remembered")
    model = generate(tmp_path / "tiny.gguf", "tiny", seed=2)
    (cache / "device.json").write_text(json.dumps({"key": device_pick.key(), "device": "NOSUCHDEVICE"}))
    env = {**clean_env(), "PP_CACHE": "1", "PP_CACHE_DIR": str(cache), "STAGE": "1", "NUM_STAGES": "2",
           "MODEL": str(model), "MAX_CONTEXT": "32"}
    env.pop("DEV", None)

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pp_worker"], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)

    failed = start()
    assert failed.returncode == 2 and "NOSUCHDEVICE".lower() in failed.stderr.lower()
    assert not (cache / "device.json").exists()
    ready = start()
    assert ready.returncode == 0 and '"status": "ready"' in ready.stdout
    assert json.loads((cache / "device.json").read_text())["device"] == "CPU"
