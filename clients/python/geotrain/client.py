"""The client: one channel to the head, the public API's calls as methods (see geotrain/__init__.py). The calls
return plain Python (geotrain.results); each result's `.proto` is the message the head sent."""
import json
import os
import threading
import time
from typing import Iterator, List

import grpc
from google.protobuf import message as _message

from geotrain import spec_pb2
from geotrain.endpoint import resolve_head, resolve_tls
from geotrain.errors import InvalidArgumentError, from_rpc_error
from geotrain.follow import Follower
from geotrain.results import ClusterStatus, JobEvent, JobStatus, PlanReply, enum_name, steps_frame
from geotrain.v1 import cluster_pb2, cluster_pb2_grpc, jobs_pb2, jobs_pb2_grpc, planner_pb2, planner_pb2_grpc

TOKEN_METADATA_KEY = "x-geotrain-token"


def state_name(job_or_state):
    """A job state's short name, as the CLI shows it: "RUNNING" for a JobStatus or JobEvent, a geotrain.v1.Job or
    JobEvent message, or geotrain.v1.JOB_RUNNING (a number it does not know comes back as itself, a string)."""
    if isinstance(job_or_state, (JobStatus, JobEvent)):
        return job_or_state.state
    if isinstance(job_or_state, str):
        return job_or_state
    state = job_or_state.state if isinstance(job_or_state, _message.Message) else job_or_state
    return enum_name(jobs_pb2.JobState, state, "JOB_")


class Client:
    """A connection to a geotrain head. Thread-safe, as gRPC channels are; close() (or `with`) releases it.

    head: "HOST:PORT" (default: GEOTRAIN_HEAD, else the head recorded on this machine); token or token_file (default:
    GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE, else the recorded head's token file); tls_ca: the CA certificate (PEM file)
    that signed a TLS head's certificate; tls_cert and tls_key: this client's certificate and key (PEM files), which a
    head serving mutual TLS asks for (`deploy/make-certs.sh` makes node certificates valid for clients too). Without
    TLS arguments, GEOTRAIN_TLS_CA, GEOTRAIN_TLS_CERT and GEOTRAIN_TLS_KEY, else the TLS files a head started on this
    machine recorded (as the CLI). timeout: seconds for each call but follow()'s stream. connect_timeout: seconds a
    call waits for the connection to the head (TCP, then the TLS handshake) while it is not up, before it fails with
    UnavailableError.
    """

    def __init__(self, head=None, token=None, tls_ca=None, *, tls_cert=None, tls_key=None, token_file=None,
                 timeout=30.0, connect_timeout=5.0):
        self.endpoint = resolve_head(head, token, token_file)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        # As the C++ channels (common/rpc.h SetReconnectBackoff): retries 200 ms to 2 s apart, and each connection
        # attempt (TCP, TLS, HTTP/2 SETTINGS) allowed 5 s, which gRPC takes from min_reconnect_backoff_ms.
        options = [("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 5000), ("grpc.max_reconnect_backoff_ms", 2000),
                   ("grpc.max_receive_message_length", 64 << 20)]
        self.tls = resolve_tls(tls_ca, tls_cert, tls_key)
        if self.tls.enabled:
            cert = key = None
            if self.tls.cert or self.tls.key:
                if not (self.tls.cert and self.tls.key):
                    raise ValueError("tls_cert and tls_key go together: give both, or neither")
                cert, key = _read_pem(self.tls.cert, "tls_cert"), _read_pem(self.tls.key, "tls_key")
            ca = _read_pem(self.tls.ca, "tls_ca") if self.tls.ca else None  # None: the system's roots
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            self._channel = grpc.secure_channel(self.endpoint.address, credentials, options)
        else:
            self._channel = grpc.insecure_channel(self.endpoint.address, options)
        self._metadata = ((TOKEN_METADATA_KEY, self.endpoint.token),)
        # False until a call gets through, and again after one found the head unreachable: the next call first
        # waits for the connection (_wait_connected). A plain bool: a race costs one needless wait, nothing more.
        self._reachable = False
        self._jobs = jobs_pb2_grpc.JobsStub(self._channel)
        self._cluster = cluster_pb2_grpc.ClusterStub(self._channel)
        self._planner = planner_pb2_grpc.PlannerStub(self._channel)

    def __repr__(self):
        return f"geotrain.Client(head={self.endpoint.address!r})"

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- jobs ----

    def submit(self, spec) -> str:
        """Submits a job and returns its id. `spec`: a job file's path (YAML or JSON), a dict in the spec's shape, or
        a geotrain.spec_pb2.JobSpec. The head parses it as `geotrain job submit` parses files (an unknown key or a
        wrong type is an InvalidArgumentError naming the key); relative paths in it are taken from this process's
        working directory, as the CLI takes them."""
        return self._call(self._jobs.SubmitJob, _spec_request(jobs_pb2.SubmitJobRequest(), spec)).job_id

    def status(self, job_id) -> JobStatus:
        """The job: state ("RUNNING"), message, spec, progress, actors, faults (a JobStatus; .proto: the
        geotrain.v1.Job)."""
        return JobStatus.from_proto(self._call(self._jobs.GetJob, jobs_pb2.GetJobRequest(job_id=job_id)))

    def jobs(self) -> List[JobStatus]:
        """Every job the head knows, oldest first."""
        return [JobStatus.from_proto(j) for j in self._call(self._jobs.ListJobs, jobs_pb2.ListJobsRequest()).jobs]

    def cancel(self, job_id) -> JobStatus:
        """Cancels a job that has not ended and stops its actors; FailedPreconditionError once it has ended."""
        return JobStatus.from_proto(self._call(self._jobs.CancelJob, jobs_pb2.CancelJobRequest(job_id=job_id)))

    def follow(self, job_id, after_seq=0, reconnect_seconds=60.0, *, on_event=None, on_end=None, background=False):
        """The job's events (JobEvent: its whole log, then each new event as it happens) until the job has ended.
        Step events carry the step's figures in `event.step` (StepFigures). after_seq skips the events up to that
        one. When the head goes away (a restart), it reconnects for up to reconnect_seconds and resumes after the
        last event received, so no event is missed or repeated.

        As it is, an iterator: `for event in client.follow(job_id)` blocks until the job ends. With on_event (or
        on_end, or background=True) the events are received by a background thread and follow() returns at once
        with a Follower: on_event(event) is called with each event, on_end(follower) once at the end;
        follower.events and follower.steps hold what came so far, follower.stop() stops following (the job goes
        on), follower.wait() waits for the job's end and returns its JobStatus. follow_async() is the same as an
        async iterator."""
        if on_event is None and on_end is None and not background:
            return self._watch(job_id, after_seq, reconnect_seconds)
        return Follower(self, job_id, after_seq, reconnect_seconds, on_event, on_end)

    async def follow_async(self, job_id, after_seq=0, reconnect_seconds=60.0):
        """follow() as an async iterator, for asyncio code (and notebook cells: `async for event in ...`): the
        events are received by a background thread, so the event loop goes on between them. Leaving the loop
        early stops following once the iterator is closed (`contextlib.aclosing`, or its garbage collection)."""
        import asyncio
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        end = object()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass

        follower = Follower(self, job_id, after_seq, reconnect_seconds, on_event=put, on_end=lambda _: put(end))
        try:
            while True:
                item = await queue.get()
                if item is end:
                    break
                yield item
            if follower.error is not None:
                raise follower.error
        finally:
            follower.stop(timeout=0)

    def steps(self, job_id, as_frame=False):
        """The job's step series so far: one StepFigures record per step event, in order (step, loss, val_loss,
        tokens_per_second, step_seconds and its parts, wan_bytes and by site pair, time, ...). A job that
        restarted from a checkpoint repeats the steps after it. as_frame=True: a pandas DataFrame instead
        (steps_frame(); ImportError without pandas)."""
        records = [e.step for e in self._log(job_id) if e.step is not None]
        return steps_frame(records) if as_frame else records

    def steps_frame(self, job_id):
        """steps(job_id) as a pandas DataFrame: a column per figure, `wan_bytes[src>dst]` per site pair."""
        return self.steps(job_id, as_frame=True)

    def logs(self, job_id) -> List[str]:
        """The job's log so far, one line per event ("2026-12-02 15:24:27 actors created: ...")."""
        return [str(event) for event in self._log(job_id)]

    def wait(self, job_id) -> JobStatus:
        """Waits until the job has ended and returns it."""
        for _ in self.follow(job_id):
            pass
        return self.status(job_id)

    # ---- the cluster and the planner ----

    def cluster(self) -> ClusterStatus:
        """Sites, workers (devices, liveness), measured site links, actors, and jobs by state."""
        status = self._call(self._cluster.GetClusterStatus, cluster_pb2.GetClusterStatusRequest())
        status.head_address = status.head_address or self.endpoint.address
        return ClusterStatus.from_proto(status)

    def plan(self, spec, max_plans=5) -> PlanReply:
        """Ranks plans for `spec` (as submit() takes it) on the cluster as it is, as the head plans a
        `parallel: {plan: auto}` job: reply.plans (fastest first; plans[0] is what `plan: auto` runs; each plan's
        `parallel`, a dict, goes into a spec's parallel section to run it) and reply.explanation (why the first
        wins)."""
        request = _spec_request(planner_pb2.PlanJobRequest(max_plans=max_plans), spec)
        return PlanReply.from_proto(self._call(self._planner.PlanJob, request, timeout=max(self.timeout, 120)))

    # ----

    def _watch(self, job_id, after_seq, reconnect_seconds, stop=None, on_call=None) -> Iterator[JobEvent]:
        """follow()'s stream, resumed after the last event across head restarts. stop: a threading.Event that ends
        it quietly (its call cancelled); on_call(call) is given each WatchJob call, for cancelling it."""
        after = after_seq
        gave_up_at = None
        while stop is None or not stop.is_set():
            request = jobs_pb2.WatchJobRequest(job_id=job_id, follow=True, after_seq=after)
            self._wait_connected(self.connect_timeout if gave_up_at is None
                                 else max(0.0, min(self.connect_timeout, gave_up_at - time.monotonic())), stop)
            call = self._jobs.WatchJob(request, metadata=self._metadata)
            if on_call is not None:
                on_call(call)
            try:
                for event in call:
                    gave_up_at = None
                    self._reachable = True
                    after = event.seq
                    yield JobEvent.from_proto(event)
                return
            except grpc.RpcError as e:
                if stop is not None and stop.is_set():
                    return
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, self.endpoint.address) from None
                self._reachable = False
                gave_up_at = gave_up_at or time.monotonic() + reconnect_seconds
                if time.monotonic() > gave_up_at:
                    raise from_rpc_error(e, self.endpoint.address) from None
                (stop or threading.Event()).wait(0.2)
            finally:
                call.cancel()  # a caller that stopped iterating early: the stream ends here, not at the job's end

    def _log(self, job_id) -> List[JobEvent]:
        """The job's events recorded so far (WatchJob without follow)."""
        events = []
        self._wait_connected(min(self.connect_timeout, self.timeout))
        try:
            for event in self._jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job_id), metadata=self._metadata,
                                             timeout=self.timeout):
                events.append(JobEvent.from_proto(event))
        except grpc.RpcError as e:
            self._note_failure(e)
            raise from_rpc_error(e, self.endpoint.address) from None
        self._reachable = True
        return events

    def _call(self, method, request, timeout=None):
        timeout = timeout or self.timeout
        self._wait_connected(min(self.connect_timeout, timeout))
        try:
            response = method(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as e:
            self._note_failure(e)
            raise from_rpc_error(e, self.endpoint.address) from None
        self._reachable = True
        return response

    def _note_failure(self, error):
        self._reachable = error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _wait_connected(self, seconds, stop=None):
        """Gives a channel that is not connected up to `seconds` to connect; the call that follows fails fast, with
        gRPC's reason, if it did not. gRPC Python moves a connection attempt (the TLS handshake's round trips, the
        retry after a refused connect) forward only while a thread waits on the channel, and a fail-fast call does
        not wait: without this, a client whose first calls came before its TLS head listened never connected.
        stop (a threading.Event) cuts the wait short."""
        if self._reachable:
            return
        ready = grpc.channel_ready_future(self._channel)
        deadline = time.monotonic() + seconds
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return
                try:
                    ready.result(timeout=min(left, 0.25) if stop is not None else left)
                    return
                except grpc.FutureTimeoutError:
                    pass
        finally:
            ready.cancel()


def _read_pem(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OSError(e.errno, f"{what}: cannot read '{path}': {e.strerror}", path) from None


def _spec_request(request, spec):
    """Fills a SubmitJobRequest or PlanJobRequest with `spec` (a path, a dict or a JobSpec) and the working
    directory that relative paths are taken from."""
    request.base_dir = os.getcwd()
    if isinstance(spec, spec_pb2.JobSpec):
        request.spec.CopyFrom(spec)
    elif isinstance(spec, dict):
        request.spec_text = json.dumps(spec)
        request.spec_source = "spec"
    elif isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        with open(path) as f:
            request.spec_text = f.read()
        request.spec_source = path
        if not request.spec_text.strip():
            raise InvalidArgumentError(f"{path}: the spec file is empty", "INVALID_ARGUMENT")
    else:
        raise TypeError(f"spec must be a path, a dict or a geotrain.spec_pb2.JobSpec, not {type(spec).__name__}")
    return request

