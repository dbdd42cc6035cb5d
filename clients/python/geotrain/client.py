"""The client: one channel to the head, the public API's calls as methods (see geotrain/__init__.py)."""
import datetime
import json
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import grpc
from google.protobuf import message as _message

from geotrain import spec_pb2
from geotrain.endpoint import resolve_head
from geotrain.errors import InvalidArgumentError, from_rpc_error
from geotrain.v1 import cluster_pb2, cluster_pb2_grpc, jobs_pb2, jobs_pb2_grpc, planner_pb2, planner_pb2_grpc

TOKEN_METADATA_KEY = "x-geotrain-token"


def state_name(job_or_state):
    """A job state's short name, as the CLI shows it: "RUNNING" for a Job, a JobEvent or jobs_pb2.JOB_RUNNING."""
    state = job_or_state.state if isinstance(job_or_state, _message.Message) else job_or_state
    return jobs_pb2.JobState.Name(state).replace("JOB_", "", 1)


@dataclass(frozen=True)
class Step:
    """The figures of one optimizer step, over all of the job's actors."""
    step: int
    loss: float
    tokens_per_second: float
    step_seconds: float
    compute_seconds: float
    comm_wait_seconds: float
    bubble_seconds: float
    checkpoint_seconds: float
    wan_bytes: int  # sent across sites in this step
    wan_bytes_by_pair: Dict[str, int] = field(default_factory=dict)  # "src>dst" -> bytes
    compression_ratio: float = 0.0
    tokens: int = 0

    @staticmethod
    def from_proto(figures):
        return Step(figures.step, figures.loss, figures.tokens_per_second, figures.step_seconds,
                    figures.compute_seconds, figures.comm_wait_seconds, figures.bubble_seconds,
                    figures.checkpoint_seconds, figures.wan_bytes, dict(figures.wan_bytes_by_pair),
                    figures.compression_ratio, figures.tokens)


@dataclass(frozen=True)
class Event:
    """One event of a job's log: a state change ("state"), a log line ("log") or a step ("step", with `step`)."""
    seq: int  # increases along the job's events: follow(job_id, after_seq=event.seq) resumes after it
    time: datetime.datetime
    job_id: str
    state: str  # the job's state after this event: "PENDING", "RUNNING", ...
    kind: str
    line: str
    step: Optional[Step] = None

    @staticmethod
    def from_proto(event):
        return Event(event.seq, datetime.datetime.fromtimestamp(event.unix_ms / 1000), event.job_id,
                     state_name(event.state), event.kind, event.line,
                     Step.from_proto(event.step) if event.HasField("step") else None)

    def __str__(self):
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.line}"


class Client:
    """A connection to a geotrain head. Thread-safe, as gRPC channels are; close() (or `with`) releases it.

    head: "HOST:PORT" (default: GEOTRAIN_HEAD, else the head recorded on this machine); token or token_file (default:
    GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE, else the recorded head's token file); tls_ca: the CA certificate (PEM file)
    that signed a TLS head's certificate; tls_cert and tls_key: this client's certificate and key (PEM files), which a
    head serving mutual TLS asks for (`deploy/make-certs.sh` makes node certificates valid for clients too).
    timeout: seconds for each call but follow()'s stream. connect_timeout: seconds a call waits for the connection to
    the head (TCP, then the TLS handshake) while it is not up, before it fails with UnavailableError.
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
        if tls_ca:
            with open(tls_ca, "rb") as f:
                ca = f.read()
            cert = key = None
            if tls_cert or tls_key:
                if not (tls_cert and tls_key):
                    raise ValueError("tls_cert and tls_key go together: give both, or neither")
                with open(tls_cert, "rb") as f:
                    cert = f.read()
                with open(tls_key, "rb") as f:
                    key = f.read()
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

    def status(self, job_id) -> jobs_pb2.Job:
        """The job (geotrain.v1.Job): state (state_name(job) gives "RUNNING"), message, plan, progress, actors,
        faults."""
        return self._call(self._jobs.GetJob, jobs_pb2.GetJobRequest(job_id=job_id))

    def jobs(self) -> List[jobs_pb2.Job]:
        """Every job the head knows, oldest first."""
        return list(self._call(self._jobs.ListJobs, jobs_pb2.ListJobsRequest()).jobs)

    def cancel(self, job_id) -> jobs_pb2.Job:
        """Cancels a job that has not ended and stops its actors; FailedPreconditionError once it has ended."""
        return self._call(self._jobs.CancelJob, jobs_pb2.CancelJobRequest(job_id=job_id))

    def follow(self, job_id, after_seq=0, reconnect_seconds=60.0) -> Iterator[Event]:
        """Yields the job's events (its whole log, then each new event as it happens) until the job has ended.
        Step events carry the step's figures in `event.step`. after_seq skips the events up to that one. When the
        head goes away (a restart), it reconnects for up to reconnect_seconds and resumes after the last event
        it yielded, so no event is missed or repeated."""
        after = after_seq
        gave_up_at = None
        while True:
            request = jobs_pb2.WatchJobRequest(job_id=job_id, follow=True, after_seq=after)
            self._wait_connected(self.connect_timeout if gave_up_at is None
                                 else max(0.0, min(self.connect_timeout, gave_up_at - time.monotonic())))
            try:
                for event in self._jobs.WatchJob(request, metadata=self._metadata):
                    gave_up_at = None
                    self._reachable = True
                    after = event.seq
                    yield Event.from_proto(event)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, self.endpoint.address) from None
                self._reachable = False
                gave_up_at = gave_up_at or time.monotonic() + reconnect_seconds
                if time.monotonic() > gave_up_at:
                    raise from_rpc_error(e, self.endpoint.address) from None
                time.sleep(0.2)

    def logs(self, job_id) -> List[str]:
        """The job's log so far, one line per event ("2026-12-02 15:24:27 actors created: ...")."""
        lines = []
        self._wait_connected(min(self.connect_timeout, self.timeout))
        try:
            for event in self._jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job_id), metadata=self._metadata,
                                             timeout=self.timeout):
                lines.append(str(Event.from_proto(event)))
        except grpc.RpcError as e:
            self._note_failure(e)
            raise from_rpc_error(e, self.endpoint.address) from None
        self._reachable = True
        return lines

    def wait(self, job_id) -> jobs_pb2.Job:
        """Waits until the job has ended and returns it."""
        for _ in self.follow(job_id):
            pass
        return self.status(job_id)

    # ---- the cluster and the planner ----

    def cluster(self) -> cluster_pb2.ClusterStatus:
        """Sites, workers (devices, liveness), measured site links, actors, and jobs by state."""
        status = self._call(self._cluster.GetClusterStatus, cluster_pb2.GetClusterStatusRequest())
        status.head_address = status.head_address or self.endpoint.address
        return status

    def plan(self, spec, max_plans=5) -> planner_pb2.PlanJobReply:
        """Ranks plans for `spec` (as submit() takes it) on the cluster as it is, as the head plans a
        `parallel: {plan: auto}` job: reply.plans (fastest first; plans[0] is what `plan: auto` runs; each plan's
        `parallel` goes into a spec's parallel section to run it) and reply.explanation (why the first wins)."""
        request = _spec_request(planner_pb2.PlanJobRequest(max_plans=max_plans), spec)
        return self._call(self._planner.PlanJob, request, timeout=max(self.timeout, 120))

    # ----

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

    def _wait_connected(self, seconds):
        """Gives a channel that is not connected up to `seconds` to connect; the call that follows fails fast, with
        gRPC's reason, if it did not. gRPC Python moves a connection attempt (the TLS handshake's round trips, the
        retry after a refused connect) forward only while a thread waits on the channel, and a fail-fast call does
        not wait: without this, a client whose first calls came before its TLS head listened never connected."""
        if self._reachable:
            return
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=seconds)
        except grpc.FutureTimeoutError:
            pass
        finally:
            ready.cancel()


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

