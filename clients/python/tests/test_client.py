"""geotrain.Client against a real `cluster up` cluster: it finds the head as the CLI does, submits (a dict or a
file), follows a job to its end with every step's figures (in the foreground, in a background thread, as an async
iterator), returns plain Python results and the step series, lists, cancels and plans, and its errors carry the
head's message and code."""
import asyncio
import dataclasses
import datetime
import json
import os
import sys
import threading
import time

import pytest

import geotrain
from conftest import tiny_spec


def wait_for_workers(client, count, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.cluster()
        if len(status.alive_workers) >= count:
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
    assert job.step == 6 and job.spec["train"]["steps"] == 6
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
    assert client.status(job_id).spec["data"]["train"] == corpus
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
    assert all(p.parallel["plan"] == "manual" for p in reply.plans)
    assert reply.explanation, "the planner says why the first plan wins"
    # The CLI ranks through the same call (the links measured meanwhile may reorder close plans).
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(spec))
    shown = json.loads(cluster.cli(["job", "plan", str(path), "--top", "3", "--json"]).stdout)
    assert [p["rank"] for p in shown["plans"]] == list(range(1, len(shown["plans"]) + 1))
    assert shown["alive_workers"] == 4 and shown["explanation"]


# ---- plain Python results ----

# The message each result is made from, and its fields under another name (`*_unix_ms` times become datetimes).
RESULTS = [
    (geotrain.JobStatus, geotrain.v1.jobs_pb2.Job, {"submitted_unix_ms": "submitted", "updated_unix_ms": "updated"}),
    (geotrain.JobEvent, geotrain.v1.jobs_pb2.JobEvent, {"unix_ms": "time"}),
    (geotrain.StepFigures, geotrain.v1.jobs_pb2.StepFigures, {}),
    (geotrain.Fault, geotrain.v1.jobs_pb2.Fault, {"detected_unix_ms": "detected"}),
    (geotrain.Replicas, geotrain.v1.jobs_pb2.Replicas, {}),
    (geotrain.Actor, geotrain.v1.cluster_pb2.Actor, {}),
    (geotrain.ClusterStatus, geotrain.v1.cluster_pb2.ClusterStatus, {"head_started_unix_ms": "head_started"}),
    (geotrain.Worker, geotrain.v1.cluster_pb2.Worker,
     {"registered_unix_ms": "registered", "last_heartbeat_unix_ms": "last_heartbeat"}),
    (geotrain.Device, geotrain.v1.cluster_pb2.Device, {}),
    (geotrain.Site, geotrain.v1.cluster_pb2.Site, {}),
    (geotrain.SiteLink, geotrain.v1.cluster_pb2.SiteLink, {}),
    (geotrain.PlanReply, geotrain.v1.planner_pb2.PlanJobReply, {}),
    (geotrain.RankedPlan, geotrain.v1.planner_pb2.RankedPlan, {}),
    (geotrain.CrossSiteTraffic, geotrain.v1.planner_pb2.CrossSiteTraffic, {}),
]


def test_every_field_of_the_messages_is_a_field_of_the_results():
    for cls, message, renamed in RESULTS:
        expected = {renamed.get(name, name) for name in message.DESCRIPTOR.fields_by_name}
        if cls is geotrain.StepFigures:
            expected.add("time")  # its event's
        assert {f.name for f in dataclasses.fields(cls)} == expected, cls.__name__


def test_results_from_messages_unknown_enum_values_and_the_old_names():
    figures = geotrain.v1.jobs_pb2.StepFigures(step=3, loss=2.5, val_loss=-1, wan_bytes=10,
                                              wan_bytes_by_pair={"a>b": 6, "b>a": 4})
    event = geotrain.JobEvent.from_proto(geotrain.v1.jobs_pb2.JobEvent(
        seq=7, unix_ms=1_700_000_000_000, job_id="job-000001", state=geotrain.v1.jobs_pb2.JOB_RUNNING, kind="step",
        line="step 3", step=figures))
    assert event.state == "RUNNING" and event.time == datetime.datetime.fromtimestamp(1_700_000_000)
    assert event.step.val_loss is None and event.step.time == event.time
    assert event.step.wan_bytes_by_pair == {"a>b": 6, "b>a": 4} and type(event.step.wan_bytes_by_pair) is dict
    assert event.proto.step is not None and event.step.proto == figures
    assert geotrain.StepFigures.from_proto(geotrain.v1.jobs_pb2.StepFigures(val_loss=0.0)).val_loss == 0.0
    # A state this client does not know is shown as it is, not an error (docs/api.md, "Compatibility").
    assert geotrain.JobStatus.from_proto(geotrain.v1.jobs_pb2.Job(state=42)).state == "42"
    assert geotrain.state_name(42) == "42" and geotrain.state_name(geotrain.v1.jobs_pb2.JOB_FAILED) == "FAILED"
    assert geotrain.Event is geotrain.JobEvent and geotrain.Step is geotrain.StepFigures


def _protobuf_free(value, path="result"):
    """Asserts that a dataclasses.asdict() holds plain Python only."""
    from google.protobuf.message import Message
    assert not isinstance(value, Message), path
    if isinstance(value, dict):
        for k, v in value.items():
            _protobuf_free(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _protobuf_free(v, f"{path}[{i}]")
    else:
        assert value is None or isinstance(value, (str, int, float, bool, datetime.datetime)), (path, value)


def test_results_are_plain_python_with_the_messages_at_hand(cluster, corpus):
    client = geotrain.Client()
    status = wait_for_workers(client, 4)
    assert isinstance(status, geotrain.ClusterStatus) and status.head_address == client.endpoint.address
    assert isinstance(status.proto, geotrain.v1.cluster_pb2.ClusterStatus)
    assert {w.state for w in status.workers} == {"ALIVE"} and len(status.alive_workers) == 4
    for worker in status.workers:
        assert worker.site in ("site-a", "site-b") and worker.pid > 0
        assert isinstance(worker.registered, datetime.datetime) and worker.last_heartbeat >= worker.registered
        assert [d.kind for d in worker.devices] == ["EMULATED"] and "T4" in worker.devices[0].name
    _protobuf_free(dataclasses.asdict(status))

    spec = tiny_spec("plain", corpus, steps=2)
    spec["parallel"] = {"plan": "auto"}
    ranked = client.plan(spec, max_plans=2)
    assert isinstance(ranked, geotrain.PlanReply) and isinstance(ranked.proto, geotrain.v1.planner_pb2.PlanJobReply)
    best = ranked.plans[0]
    assert best.parallel["plan"] == "manual" and best.parallel["dp"] * best.parallel["pp"] == best.devices
    # What is set, nothing at its default (a head older than this client refuses keys added since), ints as ints.
    assert geotrain.message_to_dict(geotrain.spec_pb2.ParallelSpec(
        plan="manual", dp=2, placement=[geotrain.spec_pb2.PlacementSpec(replica=0, site="a"),
                                        geotrain.spec_pb2.PlacementSpec(replica=1, site="b")])) == {
        "plan": "manual", "dp": 2, "placement": [{"site": "a"}, {"replica": 1, "site": "b"}]}
    assert geotrain.message_to_dict(geotrain.spec_pb2.FaultToleranceSpec(max_restarts=0)) == {"max_restarts": 0}
    _protobuf_free(dataclasses.asdict(ranked))
    # A plan's parallel section goes into a spec as it is, and the job runs that plan.
    spec["parallel"] = best.parallel
    job = client.wait(client.submit(spec))
    assert isinstance(job, geotrain.JobStatus) and job.state == "SUCCEEDED" and job.ended, job.message
    assert {k: job.spec["parallel"].get(k) for k in ("dp", "pp")} == {k: best.parallel[k] for k in ("dp", "pp")}
    assert job.spec["train"]["seed"] == 3 and type(job.spec["train"]["seed"]) is int  # uint64: an int, not "3"
    assert client.wait(client.submit(dict(job.spec, name="again"))).state == "SUCCEEDED", "a spec goes back in"
    assert job.submitted <= job.updated and job.step == 2 and job.faults == [] and job.restarts == 0
    assert job.proto.job_id == job.job_id and geotrain.state_name(job.proto) == "SUCCEEDED"
    assert {a.state for a in client.status(job.job_id).actors} <= {"ALIVE", "DEAD", "PENDING_CREATION"}
    plain = dataclasses.asdict(job)
    _protobuf_free(plain)
    assert "proto" not in plain and json.loads(json.dumps(plain, default=str))["job_id"] == job.job_id
    # Equal results compare equal, whatever their messages: the same job read back from its message (a second
    # status call would race the workers' late actor records).
    assert geotrain.JobStatus.from_proto(job.proto) == job, "equal results compare equal, whatever their messages"


# ---- following in the background ----

def test_follow_in_the_background_while_the_caller_goes_on(cluster, corpus):
    """follow(on_event=...) returns at once; the callback gets every event in a thread of its own while this
    thread (a notebook cell) goes on calling the head; wait() returns the ended job."""
    client = geotrain.Client()
    wait_for_workers(client, 4)
    job_id = client.submit(tiny_spec("background", corpus, steps=5))
    received, threads, ended = [], set(), []
    first_step, go_on = threading.Event(), threading.Event()

    def on_event(event):
        received.append(event)
        threads.add(threading.get_ident())
        if event.step is not None and event.step.step == 1:
            first_step.set()
            assert go_on.wait(60), "the test thread never let the follower go on"

    started = time.monotonic()
    follower = client.follow(job_id, on_event=on_event, on_end=ended.append)
    assert time.monotonic() - started < 1.0, "follow(on_event=...) returns at once"
    assert not follower.done and follower.job_id == job_id
    # The callback holds its thread at step 1; this thread goes on meanwhile.
    assert first_step.wait(120), client.logs(job_id)
    assert client.status(job_id).state in ("RUNNING", "SUCCEEDED")
    assert [s.step for s in follower.steps] == [1] and not follower.done
    go_on.set()
    job = follower.wait(timeout=120)
    assert job.state == "SUCCEEDED" and follower.done and not follower.stopped and follower.error is None
    assert threads and threading.get_ident() not in threads
    assert ended == [follower], "on_end: once, with the follower"
    assert received == follower.events and follower.state == "SUCCEEDED"
    assert [s.step for s in follower.steps] == [1, 2, 3, 4, 5]
    # The same events as following in the foreground.
    assert [e.seq for e in client.follow(job_id)] == [e.seq for e in received]

    # The step series: records (and a DataFrame when pandas is installed), the same as the follower saw.
    steps = client.steps(job_id)
    assert steps == follower.steps and all(isinstance(s, geotrain.StepFigures) for s in steps)
    for s in steps:
        assert s.loss > 0 and s.tokens_per_second > 0 and s.step_seconds >= s.compute_seconds > 0
        assert s.tokens == 8 * 16 and s.wan_bytes == sum(s.wan_bytes_by_pair.values()) > 0
        assert s.val_loss is None, "the spec has no validation data"
        assert isinstance(s.time, datetime.datetime)
    assert [s.time for s in steps] == sorted(s.time for s in steps)


def test_steps_as_a_data_frame(cluster, corpus, monkeypatch):
    client = geotrain.Client()
    job_id = client.submit(tiny_spec("frame", corpus, steps=3))
    client.wait(job_id)
    steps = client.steps(job_id)
    assert [s.step for s in steps] == [1, 2, 3]
    try:
        import pandas
    except ImportError:
        pandas = None
    if pandas is not None:
        frame = client.steps_frame(job_id)
        assert list(frame["step"]) == [1, 2, 3] and list(frame["loss"]) == [s.loss for s in steps]
        assert frame["val_loss"].isna().all() and frame["val_loss"].dtype == float
        pairs = [c for c in frame.columns if c.startswith("wan_bytes[")]
        assert pairs and set(pairs) <= {"wan_bytes[site-a>site-b]", "wan_bytes[site-b>site-a]"}
        assert list(frame[pairs].sum(axis=1)) == list(frame["wan_bytes"])
        assert client.steps(job_id, as_frame=True).equals(frame)
        assert list(geotrain.steps_frame([]).columns) == geotrain.results.STEP_COLUMNS
    # Without pandas: an error that says what to do.
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"needs pandas.*client.steps\(job_id\)"):
        client.steps_frame(job_id)


def test_stop_ends_a_background_follow_and_the_job_goes_on(cluster, corpus):
    client = geotrain.Client()
    wait_for_workers(client, 4)
    job_id = client.submit(tiny_spec("stop-following", corpus, steps=100000))
    stepped = threading.Event()
    follower = client.follow(job_id, on_event=lambda e: e.step and stepped.set())
    try:
        assert stepped.wait(120), client.logs(job_id)
        assert follower.stop(timeout=10), "stop() ends the thread"
        assert follower.done and follower.stopped and follower.error is None
        seen = len(follower.events)
        before = client.status(job_id).step
        deadline = time.monotonic() + 60
        while client.status(job_id).step <= before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        job = client.status(job_id)
        assert job.state == "RUNNING" and job.step > before + 1, "the job goes on"
        assert len(follower.events) == seen, "no event after stop()"
    finally:
        follower.stop(timeout=0)
        client.cancel(job_id)


def test_a_background_follow_keeps_its_error(cluster, corpus, capsys):
    client = geotrain.Client()
    missing = client.follow("job-999999", background=True)
    assert missing.join(30)
    assert isinstance(missing.error, geotrain.NotFoundError)
    with pytest.raises(geotrain.NotFoundError):
        missing.wait()

    job_id = client.submit(tiny_spec("callback-fails", corpus, steps=1))
    client.wait(job_id)

    def fails(event):
        raise ValueError(f"no plot for {event.kind}")
    follower = client.follow(job_id, on_event=fails)
    assert follower.join(30)
    assert isinstance(follower.error, ValueError) and len(follower.events) == 1, "the first event ends it"
    with pytest.raises(ValueError, match="no plot for state"):
        follower.wait()
    assert "following " + job_id + " stopped: on_event raised ValueError" in capsys.readouterr().err


def test_follow_async_leaves_the_event_loop_free(cluster, corpus):
    client = geotrain.Client()
    wait_for_workers(client, 4)
    job_id = client.submit(tiny_spec("async", corpus, steps=3))

    async def follow_and_tick():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        events = [event async for event in client.follow_async(job_id)]
        done.set()
        await task
        return events, ticks

    events, ticks = asyncio.run(follow_and_tick())
    assert [e.step.step for e in events if e.step] == [1, 2, 3] and events[-1].state == "SUCCEEDED"
    assert ticks > 10, "the event loop ran while the job's events were awaited"

    async def missing():
        async for _ in client.follow_async("job-999999"):
            pass
    with pytest.raises(geotrain.NotFoundError):
        asyncio.run(missing())


def test_tls_head_with_the_ca(tmp_path):
    """A head serving TLS: the client verifies it with tls_ca=, as the CLI with --tls-ca; a plaintext client gets
    UnavailableError. Same token rule: the token file of the head's state dir. A client whose calls failed before
    the head listened connects once it does (gRPC Python drives a TLS handshake only while a call waits for it)."""
    import subprocess
    import sys
    from conftest import SOURCE_DIR
    from geotrain_testing.clusters import LocalCluster

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
        # As the CLI: GEOTRAIN_TLS_CA, GEOTRAIN_TLS_CERT and GEOTRAIN_TLS_KEY when no TLS argument is given.
        tls_env = {"GEOTRAIN_TLS_CA": os.path.join(certs, "ca.pem"),
                   "GEOTRAIN_TLS_CERT": os.path.join(certs, "server.pem"),
                   "GEOTRAIN_TLS_KEY": os.path.join(certs, "server.key")}
        os.environ.update(tls_env)
        try:
            from_environment = geotrain.Client(head=address, token_file=token_file, connect_timeout=30)
            assert from_environment.tls == geotrain.TlsFiles(*tls_env.values())
            assert from_environment.jobs() == []
        finally:
            for name in tls_env:
                del os.environ[name]
        with pytest.raises(geotrain.UnauthenticatedError):
            geotrain.Client(head=address, token="wrong", tls_ca=os.path.join(certs, "ca.pem"),
                            tls_cert=os.path.join(certs, "server.pem"),
                            tls_key=os.path.join(certs, "server.key")).jobs()
    except BaseException:
        print(c.logs(), file=sys.stderr)
        raise
    finally:
        c.close()
