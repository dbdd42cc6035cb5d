"""geotrain.Client against a real `cluster up` cluster: it finds the head as the CLI does, submits (a dict or a
file), follows a job to its end with every step's figures, lists, cancels and plans, and its errors carry the
head's message and code."""
import json
import os
import time

import pytest

import geotrain
from conftest import tiny_spec


def wait_for_workers(client, count, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.cluster()
        if sum(w.state == geotrain.v1.cluster_pb2.WORKER_ALIVE for w in status.workers) >= count:
            return status
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} alive workers after {timeout} s")


def test_finds_the_head_as_the_cli_does(cluster):
    client = geotrain.Client()  # GEOTRAIN_HOME's cluster record: the address and the token file
    status = wait_for_workers(client, 4)
    assert sorted(site.name for site in status.sites) == ["site-a", "site-b"]
    assert "token" not in repr(client.endpoint) or "characters" in repr(client.endpoint)

    with pytest.raises(geotrain.UnauthenticatedError) as refused:
        geotrain.Client(head=client.endpoint.address, token="not-the-token").jobs()
    assert refused.value.code == "UNAUTHENTICATED"
    assert f"the head at {client.endpoint.address} refused the call" in str(refused.value)

    os.environ["GEOTRAIN_HEAD"] = "127.0.0.1:1"
    try:
        with pytest.raises(geotrain.UnavailableError) as unreachable:
            geotrain.Client(timeout=3).jobs()
    finally:
        del os.environ["GEOTRAIN_HEAD"]
    assert "cannot reach the head at 127.0.0.1:1" in str(unreachable.value)


def test_submit_and_follow_a_job_to_its_end(cluster, corpus):
    client = geotrain.Client()
    wait_for_workers(client, 4)
    job_id = client.submit(tiny_spec("follow-me", corpus))
    assert job_id.startswith("job-")
    events = list(client.follow(job_id))
    steps = [e.step for e in events if e.step is not None]
    assert [s.step for s in steps] == list(range(1, 7)), [str(e) for e in events]
    for s in steps:
        assert s.loss > 0 and s.tokens_per_second > 0 and s.step_seconds > 0
        assert s.tokens == 8 * 16
        assert s.wan_bytes > 0, "stage 0 and stage 1 sit at different sites"
        assert sum(s.wan_bytes_by_pair.values()) == s.wan_bytes
        assert set(s.wan_bytes_by_pair) <= {"site-a>site-b", "site-b>site-a"}
    assert steps[-1].loss < steps[0].loss
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert events[0].kind == "state" and events[0].state == "PENDING"
    assert events[-1].state == "SUCCEEDED"

    job = client.status(job_id)
    assert geotrain.state_name(job) == "SUCCEEDED"
    assert job.step == 6 and job.spec.train.steps == 6
    assert job_id in [j.job_id for j in client.jobs()]
    # Resuming after an event yields exactly the events after it.
    middle = events[len(events) // 2].seq
    assert [e.seq for e in client.follow(job_id, after_seq=middle)] == [s for s in seqs if s > middle]
    assert client.logs(job_id) == [str(e) for e in events]


def test_a_spec_file_and_unknown_keys_as_the_cli_sees_them(cluster, corpus, tmp_path):
    client = geotrain.Client()
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"name: bad\ndata: {{train: '{corpus}'}}\ntrain: {{global_batch: 8, stepz: 3}}\n")
    with pytest.raises(geotrain.InvalidArgumentError) as error:
        client.submit(str(bad))
    assert error.value.code == "INVALID_ARGUMENT"
    assert "unknown key 'train.stepz'" in str(error.value)
    cli = cluster.cli(["job", "submit", str(bad)], check=False)
    assert cli.returncode != 0
    assert cli.stderr.strip() == f"geotrain: {error.value}", "the head parses the text as the CLI parses the file"

    with pytest.raises(geotrain.InvalidArgumentError) as typed:
        client.submit({"name": "x", "train": {"steps": "many"}})
    assert "train.steps" in str(typed.value)

    # A file with a relative data path: taken from this process's working directory, as the CLI takes it.
    good = tmp_path / "good.yaml"
    spec = tiny_spec("from-a-file", os.path.relpath(corpus, tmp_path), steps=2)
    good.write_text(json.dumps(spec))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        job_id = client.submit("good.yaml")
    finally:
        os.chdir(cwd)
    assert client.status(job_id).spec.data.train == corpus
    assert geotrain.state_name(client.wait(job_id)) == "SUCCEEDED"


def test_cancel_and_errors_of_unknown_jobs(cluster, corpus):
    client = geotrain.Client()
    job_id = client.submit(tiny_spec("cancel-me", corpus, steps=100000))
    cancelled = client.cancel(job_id)
    assert geotrain.state_name(cancelled) == "CANCELLED"
    with pytest.raises(geotrain.FailedPreconditionError):
        client.cancel(job_id)
    assert list(client.follow(job_id))[-1].state == "CANCELLED"
    with pytest.raises(geotrain.NotFoundError) as missing:
        client.status("job-999999")
    assert "job-999999" in str(missing.value)


def test_plan_ranks_plans_on_the_cluster_as_it_is(cluster, corpus, tmp_path):
    client = geotrain.Client()
    wait_for_workers(client, 4)
    spec = tiny_spec("plan-me", corpus)
    spec["parallel"] = {"plan": "auto"}
    reply = client.plan(spec, max_plans=3)
    assert reply.alive_workers == 4 and reply.devices == 4
    assert 1 <= len(reply.plans) <= 3
    assert [p.rank for p in reply.plans] == list(range(1, len(reply.plans) + 1))
    times = [p.predicted_step_seconds for p in reply.plans]
    assert times == sorted(times) and times[0] > 0
    assert all(p.parallel.plan == "manual" for p in reply.plans)
    assert reply.explanation, "the planner says why the first plan wins"
    # The CLI ranks through the same call (the links measured meanwhile may reorder close plans).
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(spec))
    shown = json.loads(cluster.cli(["job", "plan", str(path), "--top", "3", "--json"]).stdout)
    assert [p["rank"] for p in shown["plans"]] == list(range(1, len(shown["plans"]) + 1))
    assert shown["alive_workers"] == 4 and shown["explanation"]


def test_tls_head_with_the_ca(tmp_path):
    """A head serving TLS: the client verifies it with tls_ca=, as the CLI with --tls-ca; a plaintext client gets
    UnavailableError. Same token rule: the token file of the head's state dir. A client whose calls failed before
    the head listened connects once it does (gRPC Python drives a TLS handshake only while a call waits for it)."""
    import subprocess
    import sys
    from conftest import SOURCE_DIR
    from cluster_lib import LocalCluster

    c = LocalCluster(os.environ["GEOTRAIN_BIN"])
    try:
        certs = os.path.join(c.dir, "certs")
        subprocess.run(["bash", os.path.join(SOURCE_DIR, "deploy", "make-certs.sh"), certs], check=True,
                       capture_output=True)
        address = f"127.0.0.1:{c.port}"
        token_file = os.path.join(c.state_dir, "token")
        os.makedirs(c.state_dir, mode=0o700)
        with open(token_file, "w") as f:  # the head keeps a state dir's token
            f.write("0123456789abcdef0123456789abcdef\n")
        os.chmod(token_file, 0o600)
        # Mutual TLS: the client presents a certificate the head's CA signed (make-certs.sh's node certificate).
        client = geotrain.Client(head=address, token_file=token_file, tls_ca=os.path.join(certs, "ca.pem"),
                                 tls_cert=os.path.join(certs, "server.pem"), tls_key=os.path.join(certs, "server.key"),
                                 connect_timeout=1)
        with pytest.raises(geotrain.UnavailableError):
            client.jobs()  # no head yet
        c.head = c._spawn(["head", "start", "--port", str(c.port), "--metrics-port", "-1", "--state-dir",
                           c.state_dir, "--tls-cert", os.path.join(certs, "server.pem"), "--tls-key",
                           os.path.join(certs, "server.key"), "--tls-ca", os.path.join(certs, "ca.pem")],
                          "head.log")
        client.connect_timeout = 30  # the head's start, with sanitizers on a loaded machine
        assert client.cluster().head_id != ""
        assert client.jobs() == []
        with pytest.raises(geotrain.UnavailableError):
            geotrain.Client(head=address, token_file=token_file, timeout=3).jobs()
        with pytest.raises(geotrain.UnauthenticatedError):
            geotrain.Client(head=address, token="wrong", tls_ca=os.path.join(certs, "ca.pem"),
                            tls_cert=os.path.join(certs, "server.pem"),
                            tls_key=os.path.join(certs, "server.key")).jobs()
    except BaseException:
        print(c.logs(), file=sys.stderr)
        raise
    finally:
        c.close()
