"""Node reputation (coordinator/remote/reputation.py): Storj's beta scores with forgetting, kept
in a sqlite file across runs and shared by coordinators, and shown by `moeshard cluster`."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import ROOT, client_key, node_process

from moeshard.cli import main
from moeshard.coordinator.remote.reputation import DB_NAME, Reputation, ReputationError, rank_weight

LIAR, HONEST, NEW = "l" * 26, "h" * 26, "n" * 26  # node ids (any string is one)


def step(alpha: float, beta: float, v: int, lam: float, w_good: float, w_bad: float):
    """The whitepaper's update for one event of outcome v (+1 good, -1 bad), with a weight
    per outcome: alpha' = lam*alpha + w+ (1+v)/2, beta' = lam*beta + w- (1-v)/2."""
    return lam * alpha + w_good * (1 + v) / 2, lam * beta + w_bad * (1 - v) / 2


def passes(alpha: float, beta: float, n: int, lam: float = 0.99):
    """n passed audits at once, in closed form (a geometric series, as Storj's
    UpdateReputationMultiple): alpha lam^n + (1 - lam^n) / (1 - lam), beta lam^n."""
    return alpha * lam**n + (1 - lam**n) / (1 - lam), beta * lam**n


def test_each_event_follows_the_beta_update_step_by_step():
    rep = Reputation(":memory:")
    a = b = 0.5  # Beta(1/2, 1/2)
    outcomes = [True, True, False, True, False, True, True, True]
    for i, passed in enumerate(outcomes):
        rep.record_audit(HONEST, passed)
        a, b = step(a, b, 1 if passed else -1, 0.99, 1.0, 20.0)
        r = rep.record(HONEST)
        assert (r.audit_alpha, r.audit_beta) == pytest.approx((a, b), rel=1e-12, abs=1e-12)
        assert r.audit_score == pytest.approx(a / (a + b), rel=1e-12)
        if i == 3:
            assert rep.flush()  # folding a delta into the stored row changes nothing
    # by hand: pass 1.495, 0.495; pass 2.48005, 0.49005; fail 2.4552495, 20.4851495
    rep2 = Reputation(":memory:")
    for passed, want in [(True, (1.495, 0.495)), (True, (2.48005, 0.49005))]:
        rep2.record_audit(NEW, passed)
        assert (rep2.record(NEW).audit_alpha, rep2.record(NEW).audit_beta) == pytest.approx(want)
    rep2.record_audit(NEW, False)
    r = rep2.record(NEW)
    assert (r.audit_alpha, r.audit_beta) == pytest.approx((2.4552495, 20.4851495))

    ua = ub = 0.5
    for ok in [True, False, True, True, False]:
        rep.record_call(HONEST, ok, 3.0 if ok else None)
        ua, ub = step(ua, ub, 1 if ok else -1, 0.999, 1.0, 1.0)
    r = rep.record(HONEST)
    assert (r.up_alpha, r.up_beta) == pytest.approx((ua, ub), rel=1e-12)
    assert rep.score(HONEST) == pytest.approx(a / (a + b) * ua / (ua + ub), rel=1e-12)
    assert (r.audits_passed, r.audits_failed, r.calls_ok, r.calls_failed) == (6, 2, 3, 2)
    assert r.latency_ms == pytest.approx(3.0)
    rep.close()


def test_an_unknown_node_is_neutral_and_new_nodes_are_audited_at_rate_1():
    rep = Reputation(":memory:")
    assert rep.score(NEW) == 0.25 and rank_weight(0.25) == 1.75 and rank_weight(1.0) == 1.0
    assert not rep.is_disqualified(NEW) and rep.audits_seen(NEW) == 0
    for _ in range(99):
        rep.record_audit(NEW, True)
        rep.record_possession(NEW, True)  # proves storage, not compute: does not vet
    assert rep.audits_seen(NEW) == 99 and rep.audit_rate(NEW, 0.05) == 1.0
    rep.record_audit(NEW, True)
    assert rep.audit_rate(NEW, 0.05) == 0.05
    rep.close()


def test_one_failure_disqualifies_a_new_node_old_failures_fade_after_many_passes():
    rep = Reputation(":memory:")
    rep.record_audit(NEW, False)  # a new node's first audit fails: 0.495 / (0.495 + 20.495)
    assert rep.record(NEW).audit_score == pytest.approx(0.495 / 20.99)
    assert rep.is_disqualified(NEW)
    rep.record_possession(LIAR, False)  # a failed proof of possession weighs the same
    assert rep.is_disqualified(LIAR) and rep.audits_seen(LIAR) == 0

    vetted = "v" * 26  # 100 clean audits (just vetted), then a failure: still disqualified
    for _ in range(100):
        rep.record_audit(vetted, True)
    rep.record_audit(vetted, False)
    a, b = passes(0.5, 0.5, 100)
    assert rep.record(vetted).audit_score == pytest.approx(0.99 * a / (0.99 * (a + b) + 20))
    assert rep.record(vetted).audit_score == pytest.approx(0.7572, abs=1e-4)
    assert rep.is_disqualified(vetted)

    # 300 clean audits, one failure: survives, suspect (audited at rate 1)
    for _ in range(300):
        rep.record_audit(HONEST, True)
    a, b = passes(0.5, 0.5, 300)  # 95.1204, 0.0245
    assert (a, b) == pytest.approx((95.1204, 0.02452), abs=1e-4)
    rep.record_audit(HONEST, False)
    a, b = 0.99 * a, 0.99 * b + 20  # 94.1692, 20.0243
    r = rep.record(HONEST)
    assert (r.audit_alpha, r.audit_beta) == pytest.approx((a, b), rel=1e-9)
    assert r.audit_score == pytest.approx(0.82465, abs=1e-4)
    assert not r.disqualified and r.suspect and rep.audit_rate(HONEST, 0.05) == 1.0
    # ... then 300 passes: the failure weighs 20 * 0.99^300 = 0.98 now, no longer suspect
    for _ in range(300):
        rep.record_audit(HONEST, True)
    a, b = passes(a, b, 300)
    r = rep.record(HONEST)
    assert (r.audit_alpha, r.audit_beta) == pytest.approx((a, b), rel=1e-9)
    assert (a, b) == pytest.approx((99.7140, 0.98201), abs=1e-3)
    assert r.audit_score == pytest.approx(0.99025, abs=1e-4)
    assert not r.suspect and rep.audit_rate(HONEST, 0.05) == 0.05
    assert (r.audits_passed, r.audits_failed) == (600, 1)  # the counts never forget

    twice = "t" * 26  # 300 clean audits, then two failures in a row: disqualified
    for _ in range(300):
        rep.record_audit(twice, True)
    rep.record_audit(twice, False)
    rep.record_audit(twice, False)
    assert rep.record(twice).audit_score == pytest.approx(0.7007, abs=1e-4)
    assert rep.is_disqualified(twice)
    rep.close()


def test_latency_is_an_ewma_kept_across_runs(tmp_path):
    path = tmp_path / DB_NAME
    rep = Reputation(path)
    for ms in (10.0, 20.0, 30.0):
        rep.record_call(HONEST, True, ms)
    rep.record_call(HONEST, False)  # a failed call has no round trip
    # bias-corrected from an empty start: 0.05 (0.9025*10 + 0.95*20 + 30) / (1 - 0.95^3)
    assert rep.record(HONEST).latency_ms == pytest.approx(20.34180, abs=1e-5)
    rep.close()
    rep = Reputation(path)
    rep.record_call(HONEST, True, 40.0)
    assert rep.record(HONEST).latency_ms == pytest.approx(0.95 * 20.34180 + 0.05 * 40, abs=1e-5)
    rep.close()


def test_evidence_is_kept_across_runs_and_a_known_liar_starts_disqualified(tmp_path):
    path = tmp_path / "home" / DB_NAME  # its directory is made on first use
    first = Reputation(path)
    for _ in range(5):
        first.record_audit(HONEST, True)
        first.record_call(HONEST, True, 1.5)
    first.record_audit(LIAR, False)
    want = {n: first.row(n) for n in (HONEST, LIAR)}
    first.close()

    second = Reputation(path)  # the next run
    assert second.is_disqualified(LIAR) and not second.is_disqualified(HONEST)
    assert second.audits_seen(HONEST) == 5
    assert {n: second.row(n) for n in (HONEST, LIAR)} == want
    assert [r["node_id"] for r in second.snapshot()] == sorted([HONEST, LIAR])
    second.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert dict(db.execute("SELECT key, value FROM meta")) == {
            "format": "moeshard-reputation",
            "schema": "1",
        }


def test_writes_are_batched_and_two_coordinators_keep_each_others_evidence(tmp_path):
    path = tmp_path / DB_NAME
    a, b = Reputation(path, flush_interval_s=3600), Reputation(path)
    a.record_audit(LIAR, False)
    a.flush_if_due()  # not due: nothing written yet
    assert Reputation(path).record(LIAR).audits_failed == 0
    for _ in range(5):  # b has not seen a's failure, and records passes of its own
        b.record_audit(LIAR, True)
    assert not b.is_disqualified(LIAR)
    assert a.flush() and b.flush()  # a's failure first, then b's five passes
    alpha, beta = passes(*step(0.5, 0.5, -1, 0.99, 1.0, 20.0), 5)
    assert a.record(LIAR).audits_passed == 0  # a reads b's evidence at its next flush
    assert a.flush()
    for rep in (a, b, Reputation(path)):
        r = rep.record(LIAR)
        assert (r.audits_passed, r.audits_failed) == (5, 1)
        assert (r.audit_alpha, r.audit_beta) == pytest.approx((alpha, beta), rel=1e-12)
        assert rep.is_disqualified(LIAR)  # b's passes did not overwrite a's failure
    a.flush_interval_s = 0
    a.record_call(HONEST, True)
    a.flush_if_due()
    assert Reputation(path).record(HONEST).calls_ok == 1
    a.close()
    b.close()


def test_a_locked_file_delays_a_flush_and_loses_nothing(tmp_path, caplog):
    path = tmp_path / DB_NAME
    rep = Reputation(path, busy_timeout_s=0.2)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another coordinator mid-write, for longer than 0.2 s
    rep.record_audit(HONEST, True)
    with caplog.at_level(logging.WARNING):
        assert not rep.flush()
    assert "reputation not saved" in caplog.text and str(path) in caplog.text
    rep.record_audit(HONEST, False)  # recorded while the first one waits
    assert rep.record(HONEST).audits_seen == 2
    holder.execute("COMMIT")
    assert rep.flush()
    want = step(*step(0.5, 0.5, 1, 0.99, 1.0, 20.0), -1, 0.99, 1.0, 20.0)  # in order, once
    r = Reputation(path).record(HONEST)
    assert (r.audits_passed, r.audits_failed) == (1, 1)
    assert (r.audit_alpha, r.audit_beta) == pytest.approx(want, rel=1e-12)

    # a lock shorter than the busy timeout: the flush waits for it
    rep2 = Reputation(path, busy_timeout_s=5.0)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, holder.execute, ["COMMIT"]).start()
    rep2.record_call(HONEST, True)
    t0 = time.monotonic()
    assert rep2.flush() and time.monotonic() - t0 >= 0.2
    holder.close()
    rep.close()
    rep2.close()


def test_coordinators_flushing_at_once_in_two_processes(tmp_path):
    """Two processes (and two threads here) record and flush the same file concurrently:
    nobody crashes, and every call is counted once."""
    path = tmp_path / DB_NAME
    Reputation(path).close()
    script = textwrap.dedent(
        f"""
        from moeshard.coordinator.remote.reputation import Reputation
        rep = Reputation({str(path)!r})
        for i in range(300):
            rep.record_call({HONEST!r}, True, 1.0)
            if i % 10 == 0:
                rep.flush()
        rep.close()
        """
    )
    other = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE)
    errors = []

    def coordinator():
        try:
            rep = Reputation(path)
            for i in range(300):
                rep.record_call(HONEST, True, 1.0)
                rep.snapshot()
                if i % 10 == 0:
                    rep.flush()
            rep.close()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=coordinator) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, stderr = other.communicate(timeout=60)
    assert other.returncode == 0, stderr.decode()
    assert not errors
    assert Reputation(path).record(HONEST).calls_ok == 900


def test_a_bad_database_file_is_one_line_naming_it(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all\n" * 200)
    with pytest.raises(ReputationError) as err:
        Reputation(garbage)
    text = str(err.value)
    assert text.startswith(f"{garbage}: not a usable reputation database (file is not a database)")
    assert "move it aside" in text and "\n" not in text
    assert garbage.read_bytes() == b"not a database at all\n" * 200  # left as it was

    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE photos (id INTEGER)")
    with pytest.raises(ReputationError, match="not a moeshard reputation database"):
        Reputation(foreign)

    newer = tmp_path / "newer.sqlite"
    Reputation(newer).close()
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")
    with pytest.raises(ReputationError, match="schema '2', this moeshard reads schema 1"):
        Reputation(newer)

    with pytest.raises(ReputationError, match=f"^{tmp_path}: not a usable reputation database"):
        Reputation(tmp_path)  # a directory
    (tmp_path / "empty.sqlite").touch()  # an empty file is a new database
    Reputation(tmp_path / "empty.sqlite").close()


# -- `moeshard cluster` ------------------------------------------------------------------------


def test_cluster_shows_each_nodes_reputation(cluster_model, tmp_path, capsys):
    node = node_process(cluster_model)
    try:
        cli = [sys.executable, "-m", "moeshard", "cluster", str(cluster_model)]
        cli += ["--peers", str(node.spec), "--key", str(client_key().path)]
        env = dict(os.environ, MOESHARD_HOME=str(tmp_path))
        run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=ROOT, env=env)

        unknown = run(cli)  # no database yet: "new", and none is made
        assert unknown.returncode == 0, unknown.stderr
        line = next(li for li in unknown.stdout.splitlines() if node.node_id in li)
        assert line.endswith("  rep new")
        assert not (tmp_path / DB_NAME).exists()

        rep = Reputation(tmp_path / DB_NAME)  # a run before this one
        for _ in range(3):
            rep.record_audit(node.node_id, True)
        rep.record_possession(node.node_id, True)
        for ok in [True] * 9 + [False]:
            rep.record_call(node.node_id, ok, 1.0 if ok else None)
        row = rep.row(node.node_id)
        rep.close()

        shown = run(cli)
        assert shown.returncode == 0, shown.stderr
        line = next(li for li in shown.stdout.splitlines() if node.node_id in li)
        want = f"rep {row['score']:.2f} audits 3/0 avail {row['availability']:.1%} proofs 1/0"
        assert line.endswith(want), line
        assert "0 with 0 live replicas" in shown.stdout

        as_json = run([*cli, "--json"])
        assert as_json.returncode == 0, as_json.stderr
        report = json.loads(as_json.stdout)
        (entry,) = report["nodes"]
        assert entry["node_id"] == node.node_id and entry["up"] and entry["experts"] > 0
        assert entry["reputation"] == pytest.approx(row)
        assert report["coverage"]["0"] == 0

        rep = Reputation(tmp_path / DB_NAME)  # caught lying since: shown as such
        rep.record_audit(node.node_id, False)
        rep.close()
        assert run(cli).stdout.count("DISQUALIFIED") == 1

        bad = tmp_path / "bad.sqlite"  # (in this process: it fails before any node is called)
        bad.write_bytes(b"\x00garbage" * 100)
        argv = ["cluster", str(cluster_model), "--peers", str(node.spec)]
        assert main([*argv, "--reputation", str(bad)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"moeshard: error: {bad}: not a usable reputation database (file is not a "
            "database); move it aside to start afresh (losing it)"
        ]
        assert main([*argv, "--reputation", str(tmp_path / "none.sqlite")]) == 2
        assert "none.sqlite: no such reputation database" in capsys.readouterr().err
    finally:
        node.stop()
