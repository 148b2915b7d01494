"""Speculative decoding (--draft ngram): the drafter, the last stage's ``verify``, and whole pipelines whose output
must be exactly what they give without a draft (the expected tokens come from the same pipeline run without one).
"""

from __future__ import annotations

import base64
import collections
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest
from conftest import run_requests

import pp_worker
from bench import links
from pp_worker.driver.draft import MAX_GUESSES, Draft, NgramDrafter, whole_calls
from pp_worker.driver.draft_model import DraftModelError, DraftWorker
from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.bpe import build_vocab
from pp_worker.testing.modelgen import LlamaSpec, random_weights, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from train_demo import zen_text  # noqa: E402  (the embedded model's text: its vocabulary is learned on it)

# --- the drafter (pure) ---------------------------------------------------------------------------------------------


def test_ngram_guesses_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    d = NgramDrafter(max_k=3, k=3)
    assert d.propose([5, 6, 7, 8, 9, 5, 6, 7], room=10) == [8, 9, 5]  # "5 6 7" was followed by 8 9 5
    d = NgramDrafter(max_k=3, k=3)
    assert d.propose([1, 2, 3, 1, 4, 4, 2, 3], room=10) == [1, 4, 4]  # "2 3": its latest earlier occurrence
    assert NgramDrafter(max_k=3, k=3).propose([1, 2, 3, 4], room=10) == []  # nothing recurs
    assert NgramDrafter(max_k=3, k=3).propose([1, 2, 1, 2], room=1) == [1]  # never past the room left
    assert NgramDrafter(max_k=3, k=3).propose([1, 2, 1, 2], room=0) == []
    assert NgramDrafter(max_k=3).propose([5, 6, 7, 8, 9, 5, 6, 7], room=10) == [8]  # a first guess is one token


def test_a_loop_is_guessed_to_go_on_for_k_tokens():
    """The latest occurrence of the suffix ends just before it (a token repeated, a short loop): the copy runs on
    over its own guesses instead of stopping at the context's end (a random-weight model's greedy output is such a
    loop: one guess a check before, however long k)."""
    assert NgramDrafter(max_k=7, k=7).propose([9, 3, 3, 3, 3], room=10) == [3] * 7
    assert NgramDrafter(max_k=7, k=7).propose([9, 1, 2, 1, 2], room=10) == [1, 2, 1, 2, 1, 2, 1]
    assert NgramDrafter(max_k=7, k=7).propose([9, 1, 2, 1, 2], room=3) == [1, 2, 1]


def test_the_index_follows_a_growing_context():
    d, context = NgramDrafter(max_k=3, k=3), [1, 2, 3]
    assert d.propose(context, 10) == []
    context += [1, 2]
    assert d.propose(context, 10) == [3, 1, 2]


def test_a_check_is_a_power_of_two_of_rows():
    """A stage runs a check's rows as calls of its ladder (powers of two): 1, 3, 7 guesses, never 2 or 4 to 6."""
    assert [whole_calls(n) for n in range(10)] == [0, 1, 1, 3, 3, 3, 3, 7, 7, 7]
    context = [9, 8, 1, 2, 3, 4, 9, 8]  # "9 8" was followed by five tokens
    assert NgramDrafter(max_k=8, k=6).propose(context, 10) == [1, 2, 3]
    assert NgramDrafter(max_k=8, k=8).propose(context, 2) == [1]  # the room left, down to whole calls


def test_k_grows_while_guesses_are_kept_and_drafting_pauses_after_misses():
    d = NgramDrafter(max_k=8)
    for k in (3, 7, 8):  # every guess kept: k to the next check of whole calls (4, 8 rows), up to max_k
        d.update(d.k, d.k)
        assert d.k == k
    d.update(7, 1)
    assert d.k == 2  # one past what was kept
    d.update(1, 0)  # k = 2 guesses 1 (whole calls); a miss at one guess: the next step drafts nothing
    assert d.k == 1
    assert d.propose([1, 2, 1, 2], 10) == []
    assert d.propose([1, 2, 1, 2], 10) == [1]
    d.update(1, 0)  # a second miss in a row: two steps without a guess
    assert [d.propose([1, 2, 1, 2], 10) for _ in range(3)] == [[], [], [1]]
    assert (d.proposed, d.accepted) == (20, 12)


def test_behind_a_slow_link_k_grows_past_draft_max_as_a_trip_outgrows_its_compute():
    d = NgramDrafter(max_k=4)
    d.timed(0.030)
    assert d.limit == 4  # local stages (no link measured): --draft-max
    d.link_s = 0.100
    assert d.limit == MAX_GUESSES  # the fastest trip, 30 ms, was all link: as many guesses as ever allowed
    d = NgramDrafter(max_k=4, link_s=0.100)
    d.timed(0.125)  # 25 ms of compute in a trip of 125: 5x as many guesses as a trip of compute alone, at most 16
    assert d.limit == MAX_GUESSES == 16
    d.timed(0.325)  # the moving average 225 ms: a wait behind others' work makes the trip, not its compute, longer
    assert (d.trip_s, d.fastest_s) == (0.225, 0.125) and d.limit == MAX_GUESSES
    d = NgramDrafter(max_k=4, link_s=0.100)
    d.timed(0.200)  # 100 ms of compute: twice as many
    assert d.limit == 8
    for kept in (1, 3, 7):
        d.update(kept, kept)
    assert d.k == 8  # grown by doubling up to the limit
    fast_link = NgramDrafter(max_k=4, link_s=0.001)
    fast_link.timed(0.010)
    assert fast_link.limit == 4  # a link much faster than the compute: --draft-max


def test_a_repetition_penalty_drafts_nothing():
    assert Draft.usable(Sampling(temperature=0.7, seed=1))
    assert not Draft.usable(Sampling(repetition_penalty=1.1))
    assert not Draft.usable(Sampling(presence_penalty=0.5)) and not Draft.usable(Sampling(frequency_penalty=-0.5))
    assert not Draft.usable(Sampling(logprobs=0))  # a check's reply carries one token's log-probabilities
    with pytest.raises(ValueError, match="draft-max must be >= 1"):
        Draft("ngram", 0)


# --- the last stage's verify (stub) ---------------------------------------------------------------------------------
ROW = bytes(range(32))  # one stub row: hidden_dim 16, float16


def _hidden(rows: list[bytes]) -> str:
    return base64.b64encode(b"".join(rows)).decode()


def _plain(rows: list[bytes], position: int) -> list[int]:
    """What one-token steps at those positions sample, each from its own row."""
    requests = [{"op": "forward_and_sample", "request_id": 1, "hidden_b64": _hidden([r]), "position": position + i,
                 "seq_len": 1} for i, r in enumerate(rows)]
    return [r["token_id"] for r in run_requests(1, 2, requests)]


def test_verify_keeps_the_guesses_a_one_token_step_would_have_sampled():
    rows = [ROW, ROW[::-1], bytes(32), ROW[1:] + b"\0"]
    plain = _plain(rows, 5)

    def verify(drafted: list[int]) -> dict:
        (reply,) = run_requests(1, 2, [{"op": "forward_and_sample", "request_id": 1, "hidden_b64": _hidden(rows),
                                        "position": 5, "seq_len": 4, "verify": drafted}])
        return reply

    wrong = (plain[1] + 1) % 32
    assert verify(plain[:3]) == {"request_id": 1, "token_id": plain[3], "accepted": 3}
    assert verify([plain[0], wrong, plain[2]]) == {"request_id": 1, "token_id": plain[1], "accepted": 1}
    assert verify([(plain[0] + 1) % 32, *plain[1:3]])["accepted"] == 0


def test_verify_stops_at_the_first_guess_it_does_not_keep():
    rows = [ROW, ROW[::-1], bytes(32)]
    plain = _plain(rows, 0)
    check = {"op": "forward_and_sample", "request_id": 4, "hidden_b64": _hidden(rows), "position": 0, "seq_len": 3,
             "verify": [plain[0], (plain[1] + 1) % 32]}
    reply, status = run_requests(1, 2, [check, {"op": "status", "request_id": 9}])
    assert reply["accepted"] == 1
    assert status["sessions"]["4"] == 2  # rows 0 and 1 ran; row 2 followed a guess that was not kept


def test_verify_must_name_one_token_for_each_row_after_the_first():
    (reply,) = run_requests(1, 2, [{"op": "forward_and_sample", "request_id": 3, "hidden_b64": _hidden([ROW, ROW]),
                                    "position": 0, "seq_len": 2, "verify": [1, 2]}])
    assert reply["error"].startswith("'verify' must hold seq_len - 1 = 1 token ids")
    (reply,) = run_requests(1, 2, [{"op": "forward_and_sample", "request_id": 3, "hidden_b64": _hidden([ROW]),
                                    "position": 0, "seq_len": 1, "verify": "x"}])
    assert "'verify' must be a list of ints" in reply["error"]


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"presence_penalty": 0.5, "recent_tokens": [1]},
                                   {"frequency_penalty": 0.5, "recent_tokens": [1]}])
def test_verify_refuses_what_a_check_cannot_keep_exact(extra):
    (reply,) = run_requests(1, 2, [{"op": "forward_and_sample", "request_id": 3, "hidden_b64": _hidden([ROW, ROW]),
                                    "position": 0, "seq_len": 2, "verify": [1], **extra}])
    assert reply["error"].startswith("'verify' cannot go with")


# --- real pipelines on the embedded model ---------------------------------------------------------------------------
PASSAGE = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."
PROMPTS = [f"{PASSAGE} {PASSAGE} {PASSAGE}", "Errors should never", "Now is better than never", "Flat is"]


@pytest.fixture(scope="module")
def pipeline():
    launch = Launch(2, env={"PP_WIRE_DTYPE": "f32", "MAX_CONTEXT": "160"})
    with Pipeline(launch, log=io.StringIO()) as p:
        yield p


def _run(p: Pipeline, draft: Draft | None, sampling: Sampling, concurrency: int = 1, max_tokens: int = 40):
    p.draft = draft
    try:
        return p.run(make_generations(p, PROMPTS, max_tokens, sampling), concurrency).generations
    finally:
        p.draft = None


@pytest.mark.parametrize("concurrency", [1, 4])
def test_greedy_output_with_a_draft_is_exactly_the_output_without(pipeline, concurrency):
    plain = _run(pipeline, None, Sampling(), concurrency)
    drafted = _run(pipeline, Draft("ngram", 4), Sampling(), concurrency)
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert [g.stop_reason for g in drafted] == [g.stop_reason for g in plain]
    assert drafted[0].draft.accepted > 0  # the repeated passage: guesses were checked and kept


def test_checks_of_several_generations_reach_the_last_stage_in_one_batch_with_the_same_tokens(pipeline, monkeypatch):
    """Two of each prompt, 8 in flight in lock-step: the drafting generations' checks are held and sent together, so
    the last stage gets batches of several checks (one mixed forward there, as on the stages before), and the output
    is still exactly the output without a draft."""
    checks: list[int] = []
    write = pipeline._write

    def counted(st, group):
        if st.index == len(pipeline.stages) - 1:
            checks.append(sum(call.check for _, call, _ in group))
        write(st, group)
    monkeypatch.setattr(pipeline, "_write", counted)
    plain = pipeline.run(make_generations(pipeline, PROMPTS * 2, 40, Sampling()), 8).generations
    pipeline.draft = Draft("ngram", 4)
    try:
        drafted = pipeline.run(make_generations(pipeline, PROMPTS * 2, 40, Sampling()), 8).generations
    finally:
        pipeline.draft = None
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert max(checks) >= 2, checks


def test_seeded_sampling_with_a_draft_gives_the_same_tokens(pipeline):
    sampling = Sampling(temperature=0.8, seed=11)
    plain = _run(pipeline, None, sampling)
    drafted = _run(pipeline, Draft("ngram", 4), sampling)
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert drafted[0].draft.accepted > 0


def test_a_grammar_masks_every_checked_row_as_it_masks_one_token_steps(pipeline):
    """The grammar goes with the generation's first step only (a check is an embed_and_forward too, and must not
    start a new matcher); each checked row is masked: the same tokens as without a draft, within the grammar."""
    grammar = {"type": "regex", "text": "[ a-z.]{0,60}"}  # no capitals: the recited passage must bend to it

    def run(draft: Draft | None) -> list:
        pipeline.draft = draft
        try:
            gens = make_generations(pipeline, PROMPTS[:1], 30, Sampling())
            for g in gens:
                g.grammar = grammar
            return pipeline.run(gens, 1).generations
        finally:
            pipeline.draft = None
    plain, drafted = run(None), run(Draft("ngram", 4))
    assert drafted[0].tokens == plain[0].tokens and drafted[0].draft.accepted > 0
    assert re.fullmatch(r"[ a-z.]*", drafted[0].text), drafted[0].text


def test_a_draft_stops_at_max_context_as_plain_decode_does(pipeline):
    # the repeated passage's prompt leaves room for a few tokens only: guesses must never pass max_context
    plain = _run(pipeline, None, Sampling(), max_tokens=200)
    drafted = _run(pipeline, Draft("ngram", 8), Sampling(), max_tokens=200)
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert drafted[0].stop_reason == plain[0].stop_reason == "length"


def test_drafts_work_through_a_launcher():
    relay = "sh -c 'cat | \"$0\" -m pp_worker | cat' {python}"  # a pipe in between, as ssh is
    launch = Launch(3, launcher=relay, env={"PP_WIRE_DTYPE": "f32"})
    with Pipeline(launch, log=None) as p:
        plain = _run(p, None, Sampling(), max_tokens=24)
        drafted = _run(p, Draft("ngram", 4), Sampling(), max_tokens=24)
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert drafted[0].draft.accepted > 0


def test_behind_a_slow_link_checks_guess_past_draft_max_and_the_output_is_unchanged(monkeypatch):
    """bench/relay.py puts 20 ms one way in front of each stage: the pipeline's pings measure the links (at least
    the delays they add), a trip is then mostly link, and the checks guess more than --draft-max's 2 (which stays
    the most on local stages) with exactly the tokens plain decoding gives."""
    guessed: list[int] = []
    update = NgramDrafter.update

    def counted(self, proposed, kept):
        guessed.append(proposed)
        update(self, proposed, kept)
    monkeypatch.setattr(NgramDrafter, "update", counted)
    with Pipeline(Launch(2, launcher=links.launcher(20, 0), env={"PP_WIRE_DTYPE": "f32"}), log=None) as p:
        plain = _run(p, None, Sampling(), concurrency=4, max_tokens=40)
        assert p.link_s == 0  # measured for drafts only
        drafted = _run(p, Draft("ngram", 2), Sampling(), concurrency=4, max_tokens=40)
        assert p.link_s >= 4 * 0.020  # a token's trip crosses each stage's link both ways
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert max(guessed) > 2, guessed


def test_pp_serve_takes_the_draft_flags_to_its_pipeline():
    from pp_worker.driver.flags import draft_from
    from pp_worker.driver.service import PipelineService
    from pp_worker.serve.cli import parse_args

    draft = draft_from(parse_args(["--stub", "--draft", "ngram", "--draft-max", "6"]))
    assert draft == Draft("ngram", 6)
    assert draft_from(parse_args(["--stub"])) is None
    service = PipelineService(Launch(2, stub=True), concurrency=1, log=None, draft=draft)
    try:
        assert service.pipeline.draft == draft
    finally:
        service.close()


def test_pp_serves_draft_model_compiles_its_forwards_in_the_background_as_its_stages_do(monkeypatch):
    """pp-serve's stages and its draft model both get PP_WARMUP=background (no request waits on a compile), unless
    the operator set PP_WARMUP."""
    from pp_worker.driver.flags import draft_from
    from pp_worker.serve import cli

    args = cli.parse_args(["--stub", "--draft-model", ZEN_DRAFT_GGUF, "--concurrency", "3"])
    assert cli._launch(args).env["PP_WARMUP"] == "background"
    draft = draft_from(args, cli._warmup())
    try:
        assert draft.worker.env["PP_WARMUP"] == "background" and draft.worker.env["PP_MAX_SESSIONS"] == "3"
    finally:
        draft.worker.close()
    monkeypatch.setenv("PP_WARMUP", "0")
    assert cli._warmup() == {} and "PP_WARMUP" not in cli._launch(args).env


def test_pp_serve_metrics_count_the_guessed_and_kept_tokens_as_pp_pipeline_reports_them():
    """/metrics' draft counters after one greedy completion against pp-pipeline's own summary line for the same
    prompt, stub stages and draft (``drafted N tokens, kept M``)."""
    import subprocess

    from conftest import REPO, clean_env
    from serving import Server

    prompt, flags = "a b c a b c a b c a b c", ["--stub", "--stages", "2", "--draft", "ngram"]
    run = subprocess.run([sys.executable, "-m", "pp_worker.driver", *flags, "--max-tokens", "40", "--temperature",
                          "0", prompt], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    summary = re.search(r"drafted (\d+) tokens, kept (\d+)", run.stderr)
    assert run.returncode == 0 and summary, run.stderr
    server = Server(flags)
    try:
        server.client().completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0)
        metrics = server.metrics()
    finally:
        server.stop()
    assert int(summary[1]) > 0  # else the counters would compare nothing
    assert (metrics[("pp_serve_draft_tokens_total", ())], metrics[("pp_serve_draft_tokens_kept_total", ())]) == \
        (int(summary[1]), int(summary[2]))


# --- unseeded sampling: the drafted text keeps the model's distribution ---------------------------------------------
# Two prompts, sampled at temperature 1.5: after "Flat is better than" the guess is what followed it before
# (" nested"), and after that what followed that, where the model goes on otherwise, with some spread: a check that
# kept guesses it should not (e.g. one that always kept them) would move many samples to the guessed continuation. The
# passage said twice gives spread in the first token, and after most of them guesses the model keeps.
# a guess after the first: the latest "than nested" went on " and", which the model hardly ever says (kept ~0 of
# 100); "Errors should never" goes on as the model goes on (kept ~97 of 100); the first spreads (~16 sequences)
SPREAD_PROMPTS = ["Flat is better than nested.\nFlat is better than nested and\nFlat is better than",
                  "Errors should never pass silently.\nErrors should never", f"{PASSAGE} {PASSAGE}"]
SAMPLES = 300  # per prompt and arm
P_FAIL = 1e-4  # a correct sampler fails this often by chance


def _chi2_homogeneity(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-squared statistic of two samples' category counts coming from one distribution, and its degrees
    of freedom; categories expected fewer than ``min_expected`` times in the smaller sample are pooled into one (the
    test's approximation wants about 5 in each cell)."""
    na, nb = sum(a.values()), sum(b.values())
    categories = a.keys() | b.keys()
    common = [c for c in categories if (a[c] + b[c]) * min(na, nb) / (na + nb) >= min_expected]
    rare = categories - set(common)
    cells = [(a[c], b[c]) for c in common] + ([(sum(a[c] for c in rare), sum(b[c] for c in rare))] if rare else [])
    stat = 0.0
    for ca, cb in cells:
        for count, n in ((ca, na), (cb, nb)):
            expected = (ca + cb) * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(cells) - 1


def _chi2_tail(stat: float, df: int) -> float:
    """P(chi-squared with df degrees of freedom > stat), by the Wilson-Hilferty cube-root normal approximation (a few
    per cent of the tail's value at df >= 3; no scipy in the project)."""
    h = 2 / (9 * df)
    z = ((stat / df) ** (1 / 3) - (1 - h)) / math.sqrt(h)
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_chi2_tail_matches_known_quantiles():
    assert _chi2_tail(18.307, 10) == pytest.approx(0.05, rel=0.05)  # tables: the 95th percentile at df 10
    assert _chi2_tail(29.588, 10) == pytest.approx(0.001, rel=0.1)


def test_unseeded_sampling_with_a_draft_keeps_the_models_distribution(pipeline):
    """The first three tokens sampled without a seed, as sequences (with their prompt), with and without ngram drafts:
    one distribution by a chi-squared test at P_FAIL. A last stage that kept every guess would give " and" after
    " nested" nearly every time the first prompt's first token is " nested" (the model hardly ever does): far off."""
    prompts = [p for p in SPREAD_PROMPTS for _ in range(SAMPLES)]

    def first_three(draft: Draft | None) -> tuple[collections.Counter, list]:
        pipeline.draft = draft
        try:
            gens = pipeline.run(make_generations(pipeline, prompts, 3, Sampling(temperature=1.5)), 64).generations
        finally:
            pipeline.draft = None
        return collections.Counter((g.prompt, tuple(g.tokens)) for g in gens), gens

    plain, _ = first_three(None)
    drafted, gens = first_three(Draft("ngram", 4))
    proposed, kept = sum(g.draft.proposed for g in gens), sum(g.draft.accepted for g in gens)
    assert proposed >= SAMPLES // 2 and 0 < kept < proposed  # guesses were checked, some kept and some not
    assert len(plain) >= 20  # the model spreads there: a distribution to compare, not one answer
    stat, df = _chi2_homogeneity(plain, drafted)
    assert df >= 5
    p = _chi2_tail(stat, df)
    assert p > P_FAIL, (stat, df, p, plain.most_common(8), drafted.most_common(8))


def test_a_group_waits_for_its_members_guesses_from_a_draft_model_and_checks_them_together():
    """Two generations step together (lock-step), both waiting for a draft model's guesses; B's come only after the
    pipeline has flushed once since A's came. A's check waits for B's guesses (up to half a trip through the stages)
    instead of going alone, which left B's check held until A's whole token was back (behind a link, a trip: 8
    streams at 25 ms one way made half ngram's rate with as many trips). That the wait ends (a frozen draft model
    does not stop the others): `test_a_generation_steps_on_while_another_waits_for_its_draft_model`."""
    import threading
    import time

    from pp_worker.driver.draft import Adaptive

    gate, b_asked, arrived, times = threading.Event(), threading.Event(), [], {}

    class Held(NgramDrafter):
        off_loop = True  # as a draft model's: the guesses come from a thread of their own

        def timed(self, trip_s: float) -> None:  # trips of a minute: the others' wait (half a trip) never ends first
            self.trip_s = 60.0

        def propose_later(self, context, room, then):
            def guess() -> None:
                if self is drafters[1]:  # B: once A's guesses came and the pipeline flushed since
                    b_asked.set()
                    gate.wait(30)
                    times.setdefault("b_guessed", time.monotonic())
                else:  # A: once B waits for its own too
                    b_asked.wait(30)
                then([7][:room])
            threading.Thread(target=guess, daemon=True).start()

    drafters: list[Adaptive] = []

    class Source:
        def drafter(self, max_k: int) -> Adaptive:
            drafters.append(Held(max_k=max_k, trip_s=60.0))
            return drafters[-1]

    with Pipeline(Launch(2, stub=True), log=io.StringIO(), schedule="lockstep") as p:
        proposed, flush = p._proposed, p._flush

        def on_proposed(rid, g, guesses):
            arrived.append(g.draft)
            proposed(rid, g, guesses)

        def on_flush():
            flush()
            if any(d is drafters[0] for d in arrived):  # the pipeline flushed since A's guesses came
                gate.set()
        p._proposed, p._flush = on_proposed, on_flush
        p.draft, p.trace = Draft("model", 1, Source()), []
        a, b = p.run(make_generations(p, ["one two three", "four five six"], 3, Sampling()), 2).generations
    assert all(g.draft is d for g, d in zip((a, b), drafters, strict=True)) and gate.is_set()
    sent = [(t, rid) for t, stage, rid, op, kind in p.trace if (stage, op, kind) == (0, "embed_and_forward", "send")]
    a_check, b_check = ([s for s in sent if s[1] == g.request_id][1] for g in (a, b))  # each one's after its prompt
    assert a_check[0] >= times["b_guessed"]  # A's first check went once B's guesses were there
    assert sent.index(b_check) == sent.index(a_check) + 1  # one after the other


# --- --draft-model: a small model of the same vocabulary guesses ---------------------------------------------------
ZEN_GGUF = str(Path(pp_worker.__file__).parent / "data" / "zen.gguf")
ZEN_DRAFT_GGUF = str(Path(pp_worker.__file__).parent / "data" / "zen-draft.gguf")  # tools/train_demo.py --draft


def _zen_vocab_model(path: Path, n_merges: int = 300) -> str:
    """A tiny random llama (2 blocks, one per draft stage) with the embedded model's vocabulary (the same BPE on the
    same text, as tools/train_demo.py builds it), or with another one (fewer merges): a draft that guesses badly, or
    one that cannot guess for the Zen model at all."""
    spec = LlamaSpec(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, context_length=256)
    vocab = build_vocab(zen_text(), n_merges)
    return str(write_gguf(path, spec, random_weights(spec, len(vocab.tokens), 7), vocab, name="zen-draft-test"))


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    worker = DraftWorker(_zen_vocab_model(tmp_path_factory.mktemp("draft") / "random.gguf"))
    yield worker
    worker.close()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_greedy_output_with_the_zen_draft_model_is_exactly_the_output_without(pipeline, concurrency):
    worker = DraftWorker(ZEN_DRAFT_GGUF)
    try:
        plain = _run(pipeline, None, Sampling(), concurrency)
        drafted = _run(pipeline, Draft("model", 4, worker), Sampling(), concurrency)
    finally:
        worker.close()
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert all(g.draft.accepted > g.draft.proposed // 2 for g in drafted)  # it learned the same text: kept


def _recorded(worker: DraftWorker) -> tuple[list[list[tuple[int, list[int]]]], list[tuple[int, int, int, int]]]:
    """Each round's asks (session, tokens) from now on, and (round, session, tokens, position) of every ask that went
    through the stages' ``batch`` lines."""
    rounds: list[list[tuple[int, list[int]]]] = []
    lines: list[tuple[int, int, int, int]] = []
    next_tokens, batched = worker.next_tokens, worker._batched

    def record(asks):
        rounds.append([(session, tokens) for session, (tokens, _) in asks])
        return next_tokens(asks)

    def record_lines(asks):
        lines.extend((len(rounds) - 1, session, len(tokens), position) for session, (tokens, position) in asks)
        return batched(asks)
    worker.next_tokens, worker._batched = record, record_lines
    return rounds, lines


def test_a_draft_round_runs_on_the_engines_in_process_and_in_batch_lines_of_worker_processes_with_the_same_guesses(
        pipeline, monkeypatch):
    """In the driver's process a round's guesses and feeds are one forward of each stage's engine, called directly,
    2-token feeds beside one-token guesses (a mixed forward), a prompt's window too; only a session's second ask in
    a round goes through the stages' ``batch`` lines.
    Worker processes take ``batch`` lines, where beside other generations a 2-token feed goes one token a round (a
    2-token forward runs alone on a last stage), and whole with SPLIT 1; so do in-process engines that mix no rows
    of a session (tinygrad's kernels, a GPU's). The guesses, and so the output, are the same every way."""
    from pp_worker.driver import draft_model
    from pp_worker.driver.draft import Adaptive

    # k as --draft-max alone sets it: the limit that follows the measured trips would make it (and so the guesses)
    # differ from run to run
    monkeypatch.setattr(Adaptive, "limit", property(lambda self: self.max_k))
    plain = _run(pipeline, None, Sampling(), concurrency=4)
    runs, recorded = {}, {}
    for name, processes, split, env in (("here", False, draft_model.SPLIT, {}),
                                        ("split", True, draft_model.SPLIT, {}), ("whole", True, 1, {}),
                                        ("unmixed", False, draft_model.SPLIT, {"PP_KERNELS": "tinygrad"})):
        monkeypatch.setattr(draft_model, "SPLIT", split)
        worker = DraftWorker(ZEN_DRAFT_GGUF, env, processes=processes)
        recorded[name] = _recorded(worker)
        try:
            runs[name] = _run(pipeline, Draft("model", 7, worker), Sampling(), concurrency=4)
        finally:
            worker.close()
    assert all([g.tokens for g in run] == [g.tokens for g in plain] for run in runs.values())
    assert len({tuple(g.draft.accepted for g in run) for run in runs.values()}) == 1
    (here, here_lines), (split, _), (whole, _), (unmixed, _) = (recorded[k] for k in ("here", "split", "whole",
                                                                                        "unmixed"))
    assert all([s for s, _ in here[r]].count(session) > 1 for r, session, _, _ in here_lines)  # a later ask
    assert any(len(tokens) > draft_model.SPLIT for r in here for _, tokens in r)  # the windows, straight

    def twos_beside_others(rounds: list[list[tuple[int, list[int]]]]) -> bool:
        return any(len(tokens) == 2 for r in rounds if len(r) > 1 for _, tokens in r)
    assert twos_beside_others(here) and not twos_beside_others(split) and twos_beside_others(whole)
    assert not twos_beside_others(unmixed)  # in-process engines that mix no rows of a session (tinygrad's kernels)


def test_a_small_draft_model_runs_on_one_thread_and_leaves_the_processes_threads_alone(monkeypatch):
    """The Zen draft (0.35 MB) on one thread (its forwards are fixed costs, which a helper's wake-ups add to), unless
    PP_THREADS says otherwise; a bigger one on every CPU. tinygrad's CPU_COUNT is process-wide: the process's other
    engines (here, this test's) keep theirs, its own value before and after."""
    from tinygrad.helpers import CPU_COUNT

    from pp_worker.driver import draft_model
    from pp_worker.worker.cli import default_threads

    before = CPU_COUNT.value
    for env, small, want in (({}, True, 1), ({"PP_THREADS": "3"}, True, 3), ({}, False, default_threads({}))):
        monkeypatch.setattr(draft_model, "ONE_THREAD_BYTES", 4 << 20 if small else 0)
        worker = DraftWorker(ZEN_DRAFT_GGUF, env)
        try:
            assert CPU_COUNT.value == before
            assert [status["threads"] for status in worker.status()] == [want, want]
            assert _on_draft_thread(worker, lambda w=worker: w.next_tokens([(1, ([5, 6, 7], 0))]))[0] >= 0
            assert CPU_COUNT.value == before
        finally:
            worker.close()


def _on_draft_thread(worker: DraftWorker, work):
    """``work()`` on the draft model's thread (where its stages may be called), its result."""
    import threading

    done, out = threading.Event(), []
    worker.submit(lambda: out.append(work()) or done.set())
    assert done.wait(120)
    return out[0]


def test_prompts_windows_go_straight_to_the_engines_in_forwards_compiled_already():
    """8 generations' first feeds (a prompt's window of 32 tokens each) in the driver's process: each session opened
    by a one-token forward, the rest as rows of one batch of forwards of the sizes compiled already (a forward of
    all their rows would compile one, ~2.5 s, and no guess would come meanwhile), nothing through the batch lines;
    the answers are a worker process's."""
    here, lines = DraftWorker(ZEN_DRAFT_GGUF), DraftWorker(ZEN_DRAFT_GGUF, processes=True)
    feeds = [(session, (list(range(4 + session, 36 + session)), 0)) for session in range(1, 9)]
    through_lines = []
    batched = here._batched
    here._batched = lambda asks: through_lines.extend(asks) or batched(asks)

    def compiled() -> list[int]:
        return [stage._live().engine.describe()["jits_compiled"] for stage in here.stages]

    def feed_here():
        here.next_tokens([(99, ([5], 0)), (98, ([6], 0))])  # the decode call's forward, then a batch of 2
        here.next_tokens([(99, ([7], 1)), (98, ([8], 1))])
        before = compiled()
        return before, here.next_tokens(feeds), compiled()
    try:
        before, got, after = _on_draft_thread(here, feed_here)
        assert _on_draft_thread(lines, lambda: lines.next_tokens(feeds)) == got
    finally:
        here.close()
        lines.close()
    assert after == before and through_lines == []


def test_with_background_warmup_the_draft_models_forwards_compile_in_a_child_and_no_guess_waits_on_one(
        monkeypatch, tmp_path):
    """pp-serve's PP_WARMUP=background for an in-process draft model: each stage starts a child process that
    compiles its other forwards into the cache (as a worker process's stage does) and meanwhile runs in the sizes it
    has, down to the decode call's: 8 windows and 8 guesses compile nothing on the draft's thread. close() stops
    the children."""
    monkeypatch.setenv("PP_CACHE", "1")  # the suite's is off; a cache of this test's own to compile into
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))
    worker = DraftWorker(ZEN_DRAFT_GGUF, env={"PP_WARMUP": "background"})
    children = [stage.child for stage in worker.stages]

    def compiled() -> list[int]:
        return [stage._live().engine.describe()["jits_compiled"] for stage in worker.stages]

    def rounds():
        before = compiled()
        answers = worker.next_tokens([(s, (list(range(4 + s, 36 + s)), 0)) for s in range(1, 9)])
        answers += worker.next_tokens([(s, ([9], 32)) for s in range(1, 9)])
        return before, answers, compiled()
    try:
        assert all(child is not None for child in children)
        before, answers, after = _on_draft_thread(worker, rounds)
    finally:
        worker.close()
    assert after == before and all(isinstance(a, int) for a in answers)
    assert all(child.poll() is not None for child in children)


def test_a_draft_model_that_guesses_badly_still_gives_exactly_the_output(pipeline, random_draft):
    """Random weights: nearly every guess is rejected, so the draft's session rewinds over them at each step."""
    plain = _run(pipeline, None, Sampling())
    drafted = _run(pipeline, Draft("model", 4, random_draft), Sampling())
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert sum(g.draft.proposed for g in drafted) > sum(g.draft.accepted for g in drafted)


def test_a_draft_session_the_draft_model_evicted_is_fed_again(pipeline, tmp_path):
    """Four generations drafting at once on a draft model that holds one session: each guess finds its session
    evicted by another generation's and feeds the whole context again; the output is still exact."""
    worker = DraftWorker(_zen_vocab_model(tmp_path / "random.gguf"), env={"PP_MAX_SESSIONS": "1"})
    try:
        plain = _run(pipeline, None, Sampling(), concurrency=4)
        drafted = _run(pipeline, Draft("model", 4, worker), Sampling(), concurrency=4)
    finally:
        worker.close()
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert all(g.draft.proposed > 0 for g in drafted)


def test_draft_model_flags_and_their_errors(tmp_path, capsys):
    from pp_worker.driver.cli import main
    from pp_worker.driver.flags import draft_from, draft_problem
    from pp_worker.serve.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--stub", "--draft-model", str(tmp_path / "missing.gguf")])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--stub", "--draft", "ngram", "--draft-model", ZEN_GGUF])
    assert "--draft and --draft-model: give one" in capsys.readouterr().err
    # both guess up to 7 tokens a step where a trip is all compute (fewer while guesses miss)
    assert parse_args(["--stub", "--draft", "ngram"]).draft_max == 7
    assert parse_args(["--stub", "--draft-model", ZEN_DRAFT_GGUF]).draft_max == 7
    with pytest.raises(SystemExit):
        parse_args(["--stub", "--draft-processes"])
    assert "--draft-processes goes with --draft-model" in capsys.readouterr().err
    other = _zen_vocab_model(tmp_path / "other.gguf", n_merges=100)
    draft = draft_from(parse_args(["--stub", "--draft-model", other, "--draft-max", "3", "--concurrency", "3",
                                   "--step-timeout", "7"]))
    try:
        assert draft is not None and draft.kind == "model" and draft.max_k == 3
        assert not draft.worker.processes  # in the driver's process unless --draft-processes
        assert draft.worker.step_timeout == 7  # the deadline of each of its calls
        # a draft session for each generation in flight, as the stages hold theirs
        assert [status["max_sessions"] for status in draft.worker.status()] == [3, 3]
        assert "must share the model's vocabulary" in draft_problem(draft, 553)
        assert draft_problem(draft, draft.worker.vocab_size) == ""
    finally:
        draft.worker.close()
    # pp-pipeline refuses it once the stages say their vocabulary, before any generation
    assert main(["--stages", "2", "--draft-model", other, "--max-tokens", "2", "Flat is"]) == 2
    assert "must share the model's vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize("processes, says", [(False, "cannot load: "), (True, "worker exited")])
def test_a_draft_model_that_does_not_load_is_a_clear_error(tmp_path, processes, says):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(DraftModelError, match=f"draft model .*bad.gguf: {says}"):
        DraftWorker(str(bad), processes=processes)


def test_draft_sessions_are_released_when_their_generations_end():
    """Finished, stopped, or cut short by an interrupt: each generation's session on the draft model's stages goes
    with it (the draft's stages hold none afterwards, rather than one per generation ever run). A pipeline of its
    own: an interrupted run leaves replies in flight that a later run must not meet."""
    from pp_worker.driver.generation import Generation
    from pp_worker.driver.pipeline import Interrupted

    worker, batches = DraftWorker(ZEN_DRAFT_GGUF), []
    plain_next_tokens = worker.next_tokens

    def next_tokens(asks):
        batches.append(len(asks))
        return plain_next_tokens(asks)
    worker.next_tokens = next_tokens

    def stop_at_6(g: Generation) -> None:
        g.stop_requested = len(g.tokens) >= 6

    def interrupt_at_6(g: Generation) -> None:  # as a Ctrl-C in the middle of the run
        if len(g.tokens) >= 6:
            raise Interrupted(2)
    try:
        with Pipeline(Launch(2, env={"MAX_CONTEXT": "160"}), log=None) as p:
            finished = _run(p, Draft("model", 4, worker), Sampling(), concurrency=4)
            assert all(g.draft.proposed > 0 for g in finished)
            assert max(batches) > 1  # guesses of generations drafting at once went to the draft model together
            stopped = make_generations(p, PROMPTS[:2], 40, Sampling())
            for g in stopped:
                g.on_token = stop_at_6
            p.draft = Draft("model", 4, worker)
            p.run(stopped, 2)
            assert [g.stop_reason for g in stopped] == ["stop", "stop"]
            cut = make_generations(p, PROMPTS[:2], 40, Sampling())
            cut[0].on_token = interrupt_at_6
            with pytest.raises(Interrupted):
                p.run(cut, 2)
            assert all(g.draft.proposed > 0 for g in cut)
        assert [status["sessions"] for status in worker.status()] == [{}, {}]
    finally:
        worker.close()


def test_a_generation_steps_on_while_another_waits_for_its_draft_model(pipeline):
    """The draft model's first guess is held until a generation that drafts nothing has made 3 more tokens: it only
    can if the pipeline's loop moves it on while the draft model is busy."""
    import threading

    from pp_worker.driver.generation import Generation

    worker, other_stepped, held, goal = DraftWorker(ZEN_DRAFT_GGUF), threading.Event(), [], []
    plain_next_tokens = worker.next_tokens

    def next_tokens(asks):
        if not held and asks[0][1][1] > 0:  # the first guess (not the prompt's feed, made as the prefill starts)
            goal.append(len(plain.tokens) + 3)
            held.append(other_stepped.wait(30))  # a bound so that the failure is False, not a hang
        return plain_next_tokens(asks)
    worker.next_tokens = next_tokens

    def stepped(g: Generation) -> None:
        if goal and len(g.tokens) >= goal[0]:
            other_stepped.set()
    drafting = Generation(0, PROMPTS[0], pipeline.new_request_id(), 12, Sampling())
    # a penalty of 1.0 changes no logit but drafts nothing (Draft.usable): a plain generation beside the drafting one
    plain = Generation(1, PROMPTS[1], pipeline.new_request_id(), 30, Sampling(repetition_penalty=1.0),
                       on_token=stepped)
    pipeline.draft = Draft("model", 4, worker)
    try:
        pipeline.run([drafting, plain], 2)
    finally:
        pipeline.draft = None
        worker.close()
    assert held == [True] and goal[0] <= 30 - 3
    assert plain.draft is None and drafting.draft.proposed > 0 and len(plain.tokens) == 30


def test_a_draft_model_with_less_context_than_the_text_guesses_from_its_last_tokens(pipeline):
    """The draft model holds 40 positions, the repeated passage's prompt is longer: its session is fed the prompt's
    last WINDOW tokens, and starts again from the last WINDOW when it runs out of room; the output is still exact."""
    from pp_worker.driver.draft_model import WINDOW

    worker = DraftWorker(ZEN_DRAFT_GGUF, env={"MAX_CONTEXT": "40"})
    try:
        plain = _run(pipeline, None, Sampling(), max_tokens=50)
        drafted = _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=50)
    finally:
        worker.close()
    assert len(drafted[0].prompt_tokens) > 40 > WINDOW and len(drafted[1].prompt_tokens) + 50 > 40
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert all(g.draft.accepted > 0 for g in drafted)


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_failed_pp_serve_pipeline_releases_its_generations_draft_sessions(restarts: int):
    """pp-serve's pipeline loses a stage while two generations draft: without a restart they end with the failure,
    with one they go on on the new stages (with new draft sessions); either way every session they held on the
    draft model (which outlives the pipeline) goes."""
    import signal
    import threading

    from pp_worker.driver.generation import Generation
    from pp_worker.driver.service import PipelineService, ServedGeneration

    worker, ended = DraftWorker(ZEN_DRAFT_GGUF), []
    all_ended = threading.Event()

    def on_end(g: ServedGeneration) -> None:
        ended.append(g)
        if len(ended) == 2:
            all_ended.set()

    def kill_at_6(g: Generation) -> None:  # the pipeline thread: the stage dies between two of its steps
        if len(g.tokens) == 6:
            service.pipeline.stages[1].signal(signal.SIGKILL)
    try:
        service = PipelineService(Launch(2), concurrency=2, log=None, draft=Draft("model", 4, worker),
                                  restarts=restarts, backoff_s=0)
        try:
            gens = [ServedGeneration(i, p, service.new_request_id(), 100, on_end=on_end)
                    for i, p in enumerate(PROMPTS[:2])]
            gens[0].on_token = kill_at_6
            for g in gens:
                service.submit(g)
            assert all_ended.wait(60)
        finally:
            service.close()
        if restarts:
            assert not any(g.error for g in ended) and all(g.again_of == 1 and g.draft.proposed > 0 for g in ended)
        else:  # what would have gone on on new stages ends with the failure
            assert all("stage 1 was killed" in g.error for g in ended)
        assert all(g.draft.proposed > 0 for g in gens)
        assert [status["sessions"] for status in worker.status()] == [{}, {}]
    finally:
        worker.close()


# --- a draft model that fails: the generations go on without guesses, and it is started again -----------------------
# (worker processes, --draft-processes: killed, frozen, not loading; then the draft model in the driver's process)
def _fail_at_first_guess(worker: DraftWorker, fail) -> None:
    """Call ``fail`` on the draft model's thread just before its first guess (not a prompt's feed), once."""
    plain_next_tokens, failed = worker.next_tokens, []

    def next_tokens(asks):
        if not failed and any(position > 0 for _, (_, position) in asks):
            failed.append(fail())
        return plain_next_tokens(asks)
    worker.next_tokens = next_tokens


def _fail_then_draft_again(pipeline: Pipeline, worker: DraftWorker, fail) -> list:
    """Plain generations, then drafting ones with ``fail()`` at the first guess, then drafting ones again once the
    draft model has loaded again (its worker closed after): all three give the same tokens; the last run's
    generations."""
    _fail_at_first_guess(worker, fail)
    try:
        plain = _run(pipeline, None, Sampling(), concurrency=2)
        failed = _run(pipeline, Draft("model", 4, worker), Sampling(), concurrency=2)
        worker.status()  # queued behind the restart: the draft model has loaded again
        again = _run(pipeline, Draft("model", 4, worker), Sampling(), concurrency=2)
    finally:
        worker.close()
    assert [g.tokens for g in failed] == [g.tokens for g in plain] == [g.tokens for g in again]
    return again


def test_a_draft_worker_killed_mid_generation_is_restarted_and_the_output_is_unchanged(pipeline):
    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, backoff_s=0, log=log)
    again = _fail_then_draft_again(pipeline, worker, lambda: worker.stages[1].proc.kill())
    assert "draft model failed" in log.getvalue() and "worker exited (-9)" in log.getvalue()
    assert "draft model: restarted, drafting again" in log.getvalue() and worker.failures == 1
    assert all(g.draft.proposed > 0 for g in again)


class _FrozenRestarts:
    """From now on, every draft worker process started (a restart's) is stopped (SIGSTOP) right after its start, so
    it never reaches its ready line; ``started`` is set once both are (the restart is then waiting in its load)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import os
        import signal
        import threading

        from pp_worker.driver import draft_model

        self.started, self.pids = threading.Event(), []
        plain = draft_model._Process

        def frozen(*args, **kwargs):
            process = plain(*args, **kwargs)
            os.kill(process.proc.pid, signal.SIGSTOP)
            self.pids.append(process.proc.pid)
            if len(self.pids) == 2:
                self.started.set()
            return process
        monkeypatch.setattr(draft_model, "_Process", frozen)


def test_a_restart_that_does_not_load_within_the_load_timeout_counts_as_a_failure(pipeline, monkeypatch):
    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, restarts=1, backoff_s=0, log=log)
    worker.load_timeout = 2  # the restart's (its first load had the default: under the suite's load it took longer)
    _fail_at_first_guess(worker, lambda: (_FrozenRestarts(monkeypatch), worker.stages[0].proc.kill()))
    try:
        plain = _run(pipeline, None, Sampling(), max_tokens=20)
        killed = _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=20)
        with pytest.raises(DraftModelError, match="exited"):  # queued behind the restart, which failed: no workers
            worker.status()
    finally:
        worker.close()
    assert [g.tokens for g in killed] == [g.tokens for g in plain]
    text = log.getvalue()
    assert "gave no reply within --load-timeout 2 s, killed" in text, text
    assert "drafting stays off after 1 restarts" in text and worker.down == "off" and worker.failures == 2


def test_close_during_a_restarts_load_kills_its_workers_and_returns(pipeline, monkeypatch):
    """No load timeout: before, close() joined a draft thread that waited for ever for a frozen restart's ready
    line (pp-pipeline's exit hung); now it kills the workers being loaded."""
    from conftest import gone

    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, backoff_s=0, load_timeout=None, log=log)
    freeze: list[_FrozenRestarts] = []
    _fail_at_first_guess(worker, lambda: (freeze.append(_FrozenRestarts(monkeypatch)),
                                          worker.stages[0].proc.kill()))
    try:
        _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=20)
        assert freeze and freeze[0].started.wait(60)  # the restart is in its load, its workers stopped
    finally:
        worker.close()
    assert all(gone(pid) for pid in freeze[0].pids)
    assert worker.down == "restarting" and worker.failures == 1


def test_a_draft_worker_frozen_past_the_step_timeout_is_killed_and_the_generation_goes_on(pipeline):
    import signal
    import threading

    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, step_timeout=5, backoff_s=0, log=log)
    frozen = worker.stages[1].proc
    _fail_at_first_guess(worker, lambda: frozen.send_signal(signal.SIGSTOP))
    # without a deadline the guess waits for ever: thawed later, the test fails rather than hangs
    thaw = threading.Timer(60, lambda: frozen.send_signal(signal.SIGCONT))
    thaw.start()
    try:
        plain = _run(pipeline, None, Sampling(), max_tokens=20)
        held = _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=20)
    finally:
        thaw.cancel()
        worker.close()
    assert [g.tokens for g in held] == [g.tokens for g in plain]
    assert "gave no reply within --step-timeout 5 s, killed (-9)" in log.getvalue()


def test_a_draft_model_that_fails_past_its_restarts_stays_off(pipeline):
    """Stage 0 killed at a guess, no restart: the sessions' releases that follow go to workers already gone and
    must fail at once (no step timeout here: a call that waited for one on a pipe that ended would hang until the
    suite's own timeout; it waited 120 s before)."""
    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, restarts=0, log=log, step_timeout=None)
    _fail_at_first_guess(worker, lambda: worker.stages[0].proc.kill())
    try:
        plain = _run(pipeline, None, Sampling(), max_tokens=20)
        killed = _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=20)
        later = _run(pipeline, Draft("model", 4, worker), Sampling(), max_tokens=20)
    finally:
        worker.close()
    assert [g.tokens for g in killed] == [g.tokens for g in later] == [g.tokens for g in plain]
    assert "draft model: drafting stays off after 0 restarts" in log.getvalue() and worker.down == "off"
    assert all(g.draft.proposed == 0 for g in later)


def test_pp_serve_goes_on_when_its_draft_worker_dies_and_drafts_again_after_the_restart(pipeline):
    import threading

    from pp_worker.driver.service import PipelineService, ServedGeneration
    from pp_worker.serve.app import _health

    def serve(prompts: list[str]) -> list[ServedGeneration]:
        ended = threading.Semaphore(0)
        gens = [ServedGeneration(i, p, service.new_request_id(), 30, on_end=lambda g: ended.release())
                for i, p in enumerate(prompts)]
        for g in gens:
            service.submit(g)
        assert all(ended.acquire(timeout=120) for _ in gens)
        return gens

    plain = _run(pipeline, None, Sampling(), max_tokens=30)[:2]
    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, processes=True, backoff_s=0, log=log)
    _fail_at_first_guess(worker, lambda: worker.stages[0].proc.kill())
    try:
        service = PipelineService(Launch(2, env={"PP_WIRE_DTYPE": "f32", "MAX_CONTEXT": "160"}), concurrency=2,
                                  log=log, draft=Draft("model", 4, worker))  # the module pipeline's model
        try:
            killed = serve(PROMPTS[:2])
            worker.status()  # queued behind the restart
            later = serve(PROMPTS[:2])
            health = json.loads(_health(service).body)
        finally:
            service.close()
    finally:
        worker.close()
    assert [g.error for g in killed + later] == [""] * 4 and service.restarted == 0  # the pipeline never failed
    assert [g.tokens for g in killed] == [g.tokens for g in later] == [g.tokens for g in plain]
    assert "draft model failed" in log.getvalue() and all(g.draft.proposed > 0 for g in later)
    assert health["draft_model"] == {"status": "ok", "failures": 1}


def test_a_draft_model_in_the_drivers_process_whose_engine_fails_gives_no_guesses_and_the_output_goes_on(pipeline):
    """The draft's last stage's engine raises at every guess for a while (as a forward that fails would): each of
    those guesses is that generation's error, it takes plain steps meanwhile, nothing restarts, and once the engine
    answers again the generations draft again; the output is exactly the model's."""
    from pp_worker.worker.engines.base import EngineError

    worker = DraftWorker(ZEN_DRAFT_GGUF, log=io.StringIO())
    engine = worker.stages[1].worker.engine
    plain_batch, plain_logits, failed = engine.forward_batch, engine.forward_logits, []

    def fails(plain):
        def call(*args, **kwargs):
            if len(failed) < 6:
                failed.append(args)
                raise EngineError("the forward failed")
            return plain(*args, **kwargs)
        return call
    engine.forward_batch, engine.forward_logits = fails(plain_batch), fails(plain_logits)
    try:
        plain = _run(pipeline, None, Sampling(), concurrency=2)
        log = io.StringIO()
        pipeline.log, before = log, pipeline.log
        try:
            drafted = _run(pipeline, Draft("model", 4, worker), Sampling(), concurrency=2)
        finally:
            pipeline.log = before
    finally:
        worker.close()
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert len(failed) == 6 and "no guesses at this step: DraftModelError" in log.getvalue(), log.getvalue()
    assert "the forward failed" in log.getvalue()
    assert worker.failures == 0 and worker.down == ""  # one generation's error, not the draft model's failure
    assert all(g.draft.accepted > 0 for g in drafted)  # guessed again once the engine answered


def test_a_draft_model_in_the_drivers_process_that_fails_is_loaded_again_and_the_output_is_unchanged(pipeline):
    """A call that raises out of the draft model's stages (not one request's error): the failure of the draft model,
    as a worker process's death is; its stages are loaded again in this process and the generations draft again."""
    log = io.StringIO()
    worker = DraftWorker(ZEN_DRAFT_GGUF, backoff_s=0, log=log)
    first = worker.stages

    def broken(*args):
        raise RuntimeError("the stage broke")
    again = _fail_then_draft_again(pipeline, worker,
                                   lambda: setattr(worker.stages[0]._live().engine, "forward_batch", broken))
    assert "draft model failed: RuntimeError: the stage broke" in log.getvalue()
    assert "draft model: restarted, drafting again" in log.getvalue() and worker.failures == 1
    assert all(s.closed for s in first) and worker.stages[0] is not first[0]  # new stages
    assert all(g.draft.proposed > 0 for g in again)


def test_close_while_the_draft_model_in_the_drivers_process_guesses_ends_that_guess_with_none():
    """close() comes while the draft thread is in a forward: the forward ends (it cannot be cut short), the calls
    after it fail, the guess gets none, and close() returns with the thread ended; no restart follows."""
    import threading

    from pp_worker.driver.draft_model import Guess

    worker, inside, go, got = DraftWorker(ZEN_DRAFT_GGUF), threading.Event(), threading.Event(), []
    plain_next_tokens = worker.next_tokens

    def next_tokens(asks):
        inside.set()
        assert go.wait(30)
        return plain_next_tokens(asks)
    worker.next_tokens = next_tokens
    drafter = worker.drafter(max_k=4)

    def guesses():
        return (yield [1, 2, 3], 0), (yield [4], 3)
    worker.submit(Guess(drafter.session, guesses(), got.append))
    closer = threading.Thread(target=worker.close)
    try:
        assert inside.wait(30)
        closer.start()
        with worker._wake:  # close() has begun: it waits for the thread, held here
            assert worker._wake.wait_for(lambda: worker._closing, 30)
    finally:
        go.set()
    closer.join(30)
    assert not closer.is_alive() and not worker._thread.is_alive()
    assert got == [[]] and worker.failures == 0 and worker.down == ""
    worker.submit(Guess(drafter.session, guesses(), got.append))  # closed: nothing runs any more
    assert got == [[]]


def test_the_driver_imports_tinygrad_only_for_a_draft_model_in_its_process():
    """pp-pipeline and pp-serve stay as light as without drafts (their flags, an ngram draft, the draft module
    itself); the draft model in the driver's process brings tinygrad in."""
    import subprocess

    code = f"""
import sys
from pp_worker.driver.cli import main
from pp_worker.driver.flags import draft_from
from pp_worker.serve.cli import parse_args
light = draft_from(parse_args(["--stub", "--draft", "ngram"]))
print("tinygrad" in sys.modules)
draft = draft_from(parse_args(["--stub", "--draft-model", {ZEN_DRAFT_GGUF!r}]))
print("tinygrad" in sys.modules)
draft.worker.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
