"""``--launcher ray``: 3 stages in Ray actors on a local cluster (``ray.init()`` starts one) give the same tokens
as 3 local worker processes, and a stage's exit code and stderr still reach the failure report.

One cluster serves the whole module (starting one takes ~7 s here); it is shut down at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import REPO

from pp_worker.driver.cli import parse_args
from pp_worker.driver.flags import launch_from
from pp_worker.driver.pipeline import StageFailed, run_pipeline
from pp_worker.driver.ray_launch import RayPlacement

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"
PROMPTS = ["the quick brown fox", "jumps over", "the lazy dog sleeps all day"]


@pytest.fixture(scope="module", autouse=True)
def local_cluster() -> Iterator[None]:
    yield  # the first Ray stage starts the cluster, as `pp-pipeline --launcher ray` does
    import ray

    ray.shutdown()


def test_flags_make_a_ray_launch() -> None:
    args = parse_args(["--launcher", "ray", "--ray-address", "10.0.0.1:6379", "--ray-num-gpus", "1", "--stub", "hi"])
    assert launch_from(args).ray == RayPlacement("10.0.0.1:6379", num_cpus=1.0, num_gpus=1.0)
    assert launch_from(parse_args(["--stub", "hi"])).ray is None


def test_stub_stages_in_ray_actors_equal_local_processes() -> None:
    local = run_pipeline(PROMPTS, stages=3, stub=True, max_tokens=10, concurrency=3)
    ray = run_pipeline(PROMPTS, stages=3, stub=True, max_tokens=10, concurrency=3, launcher="ray")
    assert [g.tokens for g in ray.generations] == [g.tokens for g in local.generations]
    assert [g.text for g in ray.generations] == [g.text for g in local.generations]


def test_real_stages_in_ray_actors_equal_local_processes() -> None:
    env = {"MAX_CONTEXT": "64"}
    local = run_pipeline(PROMPTS[:1], stages=3, model=str(ZEN), max_tokens=8, env=env, load_timeout=300)
    ray = run_pipeline(PROMPTS[:1], stages=3, model=str(ZEN), max_tokens=8, env=env, load_timeout=300,
                       launcher="ray")
    assert ray.generations[0].tokens == local.generations[0].tokens and ray.generations[0].text.strip()


def test_a_stage_failing_in_its_actor_is_reported_with_its_exit_code_and_stderr() -> None:
    with pytest.raises(StageFailed) as e:
        run_pipeline(["a"], stages=3, stub=True, launcher="ray", env={"MAX_CONTEXT": "zero"}, load_timeout=60)
    report = str(e.value)
    assert "exited with code 2" in report, report
    assert "MAX_CONTEXT='zero' is invalid" in report and "[ray] stage" in report, report


def test_an_uneven_split_reaches_stages_in_ray_actors() -> None:
    """--split: the probes and the stages go through the same launcher; each actor's stage holds its planned range."""
    from pp_worker.driver.generation import Sampling
    from pp_worker.driver.pipeline import Pipeline, make_generations
    from pp_worker.driver.stage_proc import Launch

    env = {"MAX_CONTEXT": "64", "PP_WIRE_DTYPE": "f32"}
    local = run_pipeline(PROMPTS[:1], stages=3, model=str(ZEN), max_tokens=8, env=env, load_timeout=300)
    with Pipeline(Launch(3, model=str(ZEN), launcher="ray", env=env, split=(2, 1, 1)), log=None,
                  load_timeout=300) as p:
        assert [st.ready["layer_range"] for st in p.stages] == [[0, 2], [2, 3], [3, 4]]
        tokens = p.run(make_generations(p, PROMPTS[:1], 8, Sampling())).generations[0].tokens
    assert tokens == local.generations[0].tokens
