"""The KV pool's size and the context it offers (engines.pool), without tinygrad; the worker's and the drivers'
settings of it (PP_KV_BYTES, --kv-memory, PP_WARMUP); and a real stage refusing at startup a cap too small for one
session, with the numbers and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, clean_env

from pp_worker.driver.flags import launch_from
from pp_worker.serve.cli import parse_args
from pp_worker.testing.modelgen import generate
from pp_worker.worker.cli import ConfigError, parse_config
from pp_worker.worker.engines.pool import PoolError, default_kv_bytes, parse_bytes, plan_pool

GIB = 1 << 30
ENV = {"STAGE": "0", "NUM_STAGES": "2"}


def test_byte_counts():
    assert parse_bytes("1048576") == 1 << 20
    assert parse_bytes("512M") == parse_bytes("512MiB") == parse_bytes(" 512mb ") == 512 << 20
    assert parse_bytes("2G") == 2 * GIB and parse_bytes("3K") == 3072
    for bad in ("", "0", "-5", "1.5G", "G", "12X", "１２"):
        with pytest.raises(ValueError, match="not a positive number of bytes"):
            parse_bytes(bad)


def test_the_default_cap_is_a_share_of_the_free_memory_within_what_the_slots_can_use():
    per = 1000  # bytes a position
    # plenty free: every slot at the full context, counted in whole pages
    assert default_kv_bytes(64 * GIB, per, 1000, 8, 0, page=256) == 8 * 1024 * per
    # little free: half of it, less the host's other stages' weights, shared by the stages
    assert default_kv_bytes(10_000_000, 100, 4096, 8, 1_000_000, host_stages=2) == (5_000_000 - 1_000_000) // 2
    # never below one session at the full context (memory is only used as pages fill)
    assert default_kv_bytes(1000, per, 4096, 8, 0) == 4096 * per
    assert default_kv_bytes(None, per, 100, 3, 0) == 300 * per  # free memory unknown: every slot


def test_the_plan_keeps_the_context_lowers_a_default_one_and_refuses_what_cannot_fit():
    per = 10
    assert plan_pool(8192, False, 1 << 30, per, 256) == plan_pool(8192, True, 1 << 30, per, 256)
    plan = plan_pool(8192, False, 1 << 30, per, 256)
    assert (plan.max_context, plan.page, plan.n_pages) == (8192, 256, (1 << 30) // (256 * per))
    lowered = plan_pool(8192, False, 3 * 256 * per + 5, per, 256)  # 3 pages and a bit
    assert (lowered.max_context, lowered.n_pages) == (768, 3)
    with pytest.raises(PoolError, match=r"holds 768 positions of 10 bytes, less than one session at max_context 8192"):
        plan_pool(8192, True, 3 * 256 * per, per, 256)
    with pytest.raises(PoolError, match=r"a KV pool of 2559 bytes \(PP_KV_BYTES\) holds no page of 256 positions"):
        plan_pool(8192, False, 256 * per - 1, per, 256)
    whole = plan_pool(4096, False, 5 * 4096 * per, per, None)  # tinygrad's attention: a page a session
    assert (whole.max_context, whole.page, whole.n_pages) == (4096, 4096, 5)
    assert plan_pool(4096, False, 100 * per, per, None).max_context == 100


def test_worker_and_driver_settings():
    assert parse_config([], ENV).kv_bytes is None and parse_config([], ENV).warmup == "0"
    assert parse_config([], ENV | {"PP_KV_BYTES": "2G", "PP_WARMUP": "background"}).kv_bytes == 2 * GIB
    assert parse_config([], ENV | {"PP_WARMUP": "background"}).warmup == "background"
    for name, value in (("PP_KV_BYTES", "lots"), ("PP_WARMUP", "2")):
        with pytest.raises(ConfigError, match=name):
            parse_config([], ENV | {name: value})
    assert launch_from(parse_args(["--stub", "--kv-memory", "1536M"])).env["PP_KV_BYTES"] == str(1536 << 20)
    with pytest.raises(SystemExit):
        parse_args(["--stub", "--kv-memory", "1.5G"])


def test_a_cap_too_small_for_one_session_is_an_error_at_startup(tmp_path: Path):
    model = generate(tmp_path / "tiny.gguf", "tiny", seed=1)
    env = {**clean_env(), **ENV, "MODEL": str(model), "MAX_CONTEXT": "512", "PP_KV_BYTES": "200K",
           "PP_KV_DTYPE": "float32"}
    proc = subprocess.run([sys.executable, "-m", "pp_worker"], env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    # stage 0 of the tiny model: 512 bytes a float32 position, so 200 KiB hold one page of 256 positions
    assert "a KV pool of 204800 bytes (PP_KV_BYTES) holds 256 positions" in proc.stderr
    assert "Traceback" not in proc.stderr  # an expected refusal, not a bug
    assert "less than one session at max_context 512" in proc.stderr
    assert '"event": "model_load_failed"' in proc.stdout and '"status": "ready"' not in proc.stdout
