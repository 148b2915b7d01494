"""Uneven splits: PP_LAYERS on the worker, --split N1,N2,... and --split auto on the driver (driver.split).

The real pipelines run the embedded model (4 blocks); their expected tokens come from the even split's run.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from conftest import REPO, clean_env, stub_env

from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, PipelineError, make_generations
from pp_worker.driver.split import AUTO, SplitError, auto_counts, check_ranges, parse_split, plan
from pp_worker.driver.stage_proc import Launch
from pp_worker.worker.cli import ConfigError, parse_config
from pp_worker.worker.gguf.header import read_header
from pp_worker.worker.gguf.tensors import stage_tensors
from pp_worker.worker.shard import Shard

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"
PROMPTS = ["Beautiful is better than", "Errors should never", "Now is better than never"]
MIB = 1 << 20


# --- the plan (pure) ----------------------------------------------------------------------------------------------
def probe(free: int | None, blocks: int = 8, block: int = MIB, first: int = 0, last: int = 0) -> dict:
    return {"status": "probe", "free_bytes": free, "total_blocks": blocks, "block_bytes": [block] * blocks,
            "first_bytes": first, "last_bytes": last}


def test_split_counts_are_parsed_and_refused_with_the_reason():
    assert parse_split("3,5", 2) == (3, 5)
    assert parse_split(AUTO, 3) == AUTO
    for text, words in (("3,5,1", "3 counts for 2 stages"), ("4,0", "stage 1 would hold 0 blocks"),
                        ("4,x", "ASCII digits"), ("4,\u0663", "ASCII digits"), ("", "ASCII digits")):
        with pytest.raises(ValueError, match=words):
            parse_split(text, 2)


def test_ranges_with_a_gap_an_overlap_or_the_wrong_total_are_refused():
    check_ranges([(0, 3), (3, 8)], 8)
    for ranges, words in (([(0, 3), (4, 8)], "gap after block 3"), ([(0, 4), (3, 8)], "overlap after block 4"),
                          ([(1, 3), (3, 8)], "gap after block 0"), ([(0, 3), (3, 7)], "covers 7 blocks; the model "
                                                                                        "has 8")):
        with pytest.raises(SplitError, match=words):
            check_ranges(ranges, 8)


def test_counts_must_add_up_to_the_models_blocks_and_fit_each_host():
    assert plan((3, 5), [probe(None), probe(None)]) == [(0, 3), (3, 8)]
    with pytest.raises(SplitError, match="covers 9 blocks; the model has 8"):
        plan((4, 5), [probe(None), probe(None)])
    with pytest.raises(SplitError, match="stage 1's host has no room: blocks \\[3, 8\\) need 5.0 MiB"):
        plan((3, 5), [probe(10 * MIB), probe(4 * MIB)])


def test_auto_gives_blocks_in_proportion_to_free_memory_head_with_the_last_stage():
    assert auto_counts([probe(30 * MIB), probe(10 * MIB)]) == (6, 2)
    assert auto_counts([probe(10 * MIB), probe(10 * MIB), probe(20 * MIB)]) == (2, 2, 4)
    # a 2 MiB head on the last stage: it takes two blocks fewer than its memory alone would give it
    assert auto_counts([probe(10 * MIB, last=2 * MIB), probe(10 * MIB, last=2 * MIB)]) == (5, 3)


def test_auto_refuses_a_host_without_room_or_without_a_free_memory_report():
    with pytest.raises(SplitError, match="host has no room"):
        plan(AUTO, [probe(4 * MIB), probe(3 * MIB)])  # 8 MiB of blocks, 7 MiB free in all
    with pytest.raises(SplitError, match="stage 1's host does not report its free memory"):
        plan(AUTO, [probe(4 * MIB), probe(None)])


# --- the worker's PP_LAYERS -----------------------------------------------------------------------------------------
def test_pp_layers_is_parsed_and_refused_with_one_line():
    env = {"STAGE": "1", "NUM_STAGES": "2"}
    assert parse_config([], env | {"PP_LAYERS": "3:16"}).layers == (3, 16)
    assert parse_config([], env).layers is None
    for value in ("3", "5:3", "3:3", "a:4", "\u0663:4", "-1:4", "0:4:5"):
        with pytest.raises(ConfigError, match="PP_LAYERS=.* is invalid"):
            parse_config([], env | {"PP_LAYERS": value})
    with pytest.raises(ConfigError, match="stage 0 must start at block 0"):
        parse_config([], {"STAGE": "0", "NUM_STAGES": "2", "PP_LAYERS": "1:4"})


def _stub(stage: int, layers: str) -> subprocess.CompletedProcess:
    env = stub_env(stage, 2, PP_LAYERS=layers)
    return subprocess.run([sys.executable, "-m", "pp_worker"], env=env, input="", capture_output=True, text=True,
                          timeout=60)


def test_the_ready_line_says_the_range_pp_layers_gave():
    done = _stub(1, "3:16")
    assert done.returncode == 0, done.stderr
    ready = next(line for line in done.stdout.splitlines() if '"status": "ready"' in line)
    assert '"layer_range": [3, 16]' in ready


@pytest.mark.parametrize(("stage", "layers", "words"), [(1, "3:15", "must end at the model's 16 blocks"),
                                                        (1, "3:17", "ends past the model's 16 blocks")])
def test_a_range_that_does_not_fit_the_model_exits_2_with_one_line(stage, layers, words):
    done = _stub(stage, layers)
    assert done.returncode == 2 and '"status": "ready"' not in done.stdout
    assert len(done.stderr.splitlines()) == 1 and words in done.stderr


# --- real pipelines -------------------------------------------------------------------------------------------------
def _tokens(launch: Launch, log: io.StringIO | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of PROMPTS, and each stage's layer_range from its ready line."""
    with Pipeline(launch, log=log) as p:
        gens = p.run(make_generations(p, PROMPTS, 12, Sampling()), concurrency=3).generations
        return [g.tokens for g in gens], [st.ready["layer_range"] for st in p.stages]


@pytest.fixture(scope="module")
def even() -> list[list[int]]:
    tokens, ranges = _tokens(Launch(2, env={"PP_WIRE_DTYPE": "f32"}))
    assert ranges == [[0, 2], [2, 4]]
    return tokens


@pytest.mark.parametrize(("counts", "ranges"), [((3, 1), [[0, 3], [3, 4]]), ((1, 2, 1), [[0, 1], [1, 3], [3, 4]])])
def test_an_uneven_split_gives_the_even_splits_greedy_tokens(even, counts, ranges):
    tokens, got = _tokens(Launch(len(counts), env={"PP_WIRE_DTYPE": "f32"}, split=counts))
    assert got == ranges
    assert tokens == even


def test_counts_that_do_not_add_up_fail_before_any_load():
    with pytest.raises(PipelineError, match="covers 3 blocks; the model has 4") as caught:
        Pipeline(Launch(2, split=(2, 1)), log=None)
    assert caught.value.exit_code == 2


# Each stage's host reports its own free memory (PP_FREE_BYTES, set per stage by the launcher, as two machines would
# report theirs): stage 0 has room for one block and the embedding, stage 1 for three and the head.
FREE = {0: 600 * 1024, 1: 1536 * 1024}
FAKE_HOSTS = (f"sh -c 'export PP_FREE_BYTES=$(( {{stage}} == 0 ? {FREE[0]} : {FREE[1]} )); exec \"$0\" -m pp_worker' "
              "{python}")


def _weights(stage: int, start: int, end: int) -> int:
    header = read_header(ZEN)
    return sum(t.nbytes for t in stage_tensors(header, Shard(stage, 2, start, end, 4)))


def test_auto_on_hosts_with_unequal_memory_picks_a_split_that_fits_both(even):
    assert _weights(0, 0, 2) > FREE[0]  # the even split would not fit stage 0's host
    log = io.StringIO()
    tokens, ranges = _tokens(Launch(2, env={"PP_WIRE_DTYPE": "f32"}, launcher=FAKE_HOSTS, split=AUTO), log)
    assert all(_weights(s, *r) <= FREE[s] for s, r in enumerate(ranges)), ranges
    assert ranges == [[0, 1], [1, 4]]
    assert tokens == even
    assert "split: stage 0: blocks [0, 1)" in log.getvalue()


def test_the_command_line_refuses_a_host_without_room():
    env = clean_env() | {"PP_FREE_BYTES": "600K"}
    done = subprocess.run([sys.executable, "-m", "pp_worker.driver", "--split", "auto", "--max-tokens", "2", "hi"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--split: stage 1's host has no room" in done.stderr or "--split: stage 0's host has no room" in done.stderr
