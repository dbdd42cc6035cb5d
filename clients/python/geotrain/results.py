"""What the client's calls return: plain Python (frozen dataclasses of str, int, float, bool, datetime, lists and
dicts), one class per message of the public API (geotrain.v1), with the same field names. Where they differ:

- enum values are their short names: a job's state is "RUNNING" (geotrain.v1.JOB_RUNNING), a worker's "ALIVE",
  an actor's "PENDING_CREATION", a device's kind "CUDA"; a value this client does not know is its number, as a
  string (docs/api.md: clients show what they do not know as it is);
- `*_unix_ms` times are datetimes (local time, as the CLI prints them) named without the suffix (`submitted`,
  `updated`, `registered`, `last_heartbeat`, `head_started`, `detected`; a JobEvent's `time`), None when unset;
- a job spec and a plan's parallel section are dicts in the job file's shape (field names as in the .proto files;
  fields at their default value, 0, "" or false, are left out, as in the API's JSON form without defaults), so that
  they go back into a spec as they are: `client.submit({..., "parallel": ranked.plans[0].parallel})`; a placement
  entry without "replica" or "stage" is replica 0 or stage 0;
- StepFigures.val_loss is None for a step without validation (the message's val_loss < 0).

Each result keeps the message it was made from in `.proto` (not a dataclass field: dataclasses.asdict() and ==
ignore it), for whoever wants the protobuf itself.
"""
import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from geotrain.v1 import cluster_pb2, jobs_pb2

FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class _Result:
    __slots__ = ()

    @property
    def proto(self):
        """The protobuf message (geotrain.v1.*) this was made from; None for one made by hand."""
        return self.__dict__.get("_proto")


def enum_name(enum_type, value, prefix):
    """An enum value's name without its prefix ("RUNNING" for JOB_RUNNING); a number it does not know as itself."""
    descriptor = enum_type.DESCRIPTOR.values_by_number.get(value)
    if descriptor is None:
        return str(value)
    name = descriptor.name
    return name[len(prefix):] if name.startswith(prefix) else name


def _time(unix_ms):
    return datetime.datetime.fromtimestamp(unix_ms / 1000) if unix_ms else None


def _is_repeated(fd):
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.29 (label is deprecated there)
    return repeated if repeated is not None else fd.label == fd.LABEL_REPEATED


def _is_map(fd):
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _single_value(fd, value):
    if fd.type == fd.TYPE_MESSAGE:
        return message_to_dict(value)
    if fd.type == fd.TYPE_ENUM:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    return value


def _field_value(fd, value):
    if _is_map(fd):
        value_fd = fd.message_type.fields_by_name["value"]
        return {key: _single_value(value_fd, v) for key, v in value.items()}
    if _is_repeated(fd):
        return [_single_value(fd, v) for v in value]
    return _single_value(fd, value)


def message_to_dict(message):
    """A message as a dict of plain values, in the shape of the API's JSON form with the .proto field names: the
    fields that are set (proto3: not at their default: 0, "", false, empty), enums by name, 64-bit integers as ints
    (JSON has strings). Leaving defaults out keeps a spec that goes back to the head to what was set: a head older
    than this client does not know the fields added since, and refuses unknown keys."""
    return {fd.name: _field_value(fd, value) for fd, value in message.ListFields()}


def _plain(cls, message, **converted):
    """cls(...) from `message`: each of cls's fields from the message's field of the same name, unless
    `converted` gives it (enums, times, nested messages)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in converted:
            values[f.name] = converted[f.name]
            continue
        fd = message.DESCRIPTOR.fields_by_name.get(f.name)
        if fd is None:
            raise TypeError(f"geotrain.{cls.__name__}: {message.DESCRIPTOR.full_name} has no field '{f.name}'; the "
                            f"package's generated modules do not match its sources (rebuild it)")
        values[f.name] = _field_value(fd, getattr(message, f.name))
    result = cls(**values)
    object.__setattr__(result, "_proto", message)
    return result


# ---- jobs (geotrain.v1 jobs.proto) ----

@dataclass(frozen=True)
class StepFigures(_Result):
    """The figures of one optimizer step, over all of the job's actors (geotrain.v1.StepFigures)."""
    step: int
    loss: float  # mean training loss over the global batch (0 on timed compute)
    tokens_per_second: float
    step_seconds: float  # the slowest actor's step
    compute_seconds: float  # forward, backward, optimizer (the slowest actor's)
    comm_wait_seconds: float  # blocked on peers
    bubble_seconds: float  # pipeline idle time the schedule implies
    checkpoint_seconds: float
    wan_bytes: int  # sent across sites in this step, all pairs
    wan_bytes_by_pair: Dict[str, int] = field(default_factory=dict)  # "src>dst" -> bytes
    compression_ratio: float = 0.0  # raw / encoded bytes across sites (0: nothing sent)
    tokens: int = 0  # tokens of the global batch
    val_loss: Optional[float] = None  # mean validation loss over the replicas; None: not evaluated at this step
    timed_compute: bool = False  # EMULATED: an emulated GPU's time was waited, nothing computed; loss not real
    loss_scale: float = 1.0  # fp16: the step's loss scale
    skipped: bool = False  # fp16: the gradients overflowed and the step (or one of its inner steps) was skipped
    outer_sync_seconds: float = 0.0  # DiLoCo: blocked at the outer sync (time-paced: waiting for the other groups)
    slowdown: float = 0.0  # EMULATED when > 1: a device was slowed by worker --slowdown (this factor)
    replica_tokens: int = 0  # the tokens one replica trained (an actor's report; 0 in the job's aggregate)
    inner_steps: int = 0  # DiLoCo sync time: the most inner steps a group took in the step (else 1)
    time: Optional[datetime.datetime] = None  # when the head recorded the step (from its event; None otherwise)

    @staticmethod
    def from_proto(figures, time=None):
        return _plain(StepFigures, figures, val_loss=figures.val_loss if figures.val_loss >= 0 else None, time=time)


@dataclass(frozen=True)
class JobEvent(_Result):
    """One event of a job's log (geotrain.v1.JobEvent): a state change (kind "state"), a log line ("log") or a
    step ("step", with `step`)."""
    seq: int  # increases along the job's events: follow(job_id, after_seq=event.seq) resumes after it
    time: datetime.datetime
    job_id: str
    state: str  # the job's state after this event: "PENDING", "RUNNING", ...
    kind: str
    line: str  # for people; read figures from `step`
    step: Optional[StepFigures] = None

    @staticmethod
    def from_proto(event):
        time = datetime.datetime.fromtimestamp(event.unix_ms / 1000)
        return _plain(JobEvent, event, time=time, state=enum_name(jobs_pb2.JobState, event.state, "JOB_"),
                      step=StepFigures.from_proto(event.step, time) if event.HasField("step") else None)

    def __str__(self):
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.line}"


@dataclass(frozen=True)
class Fault(_Result):
    """One fault of a job and what recovery did about it (geotrain.v1.Fault)."""
    cause: str
    detected: Optional[datetime.datetime]
    step: int  # the last complete step when it happened
    resumed_from: str  # the checkpoint the restart resumed from ("": the beginning)
    resumed_step: int
    steps_lost: int
    recovery_seconds: float  # detected -> first step done after the restart (0 until then)
    attempt: int  # the run that started after it

    @staticmethod
    def from_proto(fault):
        return _plain(Fault, fault, detected=_time(fault.detected_unix_ms))


@dataclass(frozen=True)
class Actor(_Result):
    """One actor of a job: a (replica, stage, tensor rank) of its plan and where it runs (geotrain.v1.Actor)."""
    actor_id: str
    job_id: str
    worker_id: str
    replica: int
    stage: int
    tp_rank: int
    device_index: int
    state: str  # "PENDING_CREATION", "ALIVE", "DEAD"
    message: str  # why it is in this state (for "DEAD": the cause)

    @staticmethod
    def from_proto(actor):
        return _plain(Actor, actor, state=enum_name(cluster_pb2.ActorState, actor.state, "ACTOR_"))


@dataclass(frozen=True)
class Replicas(_Result):
    """A job's data-parallel replicas (geotrain.v1.Replicas): fewer present than planned while the replicas a fault left
    whole train on without a restart."""
    present: int
    planned: int

    @staticmethod
    def from_proto(replicas):
        return _plain(Replicas, replicas)


@dataclass(frozen=True)
class JobStatus(_Result):
    """A job as the head knows it (geotrain.v1.Job): what status(), cancel(), wait() and jobs() return."""
    job_id: str
    name: str
    state: str  # "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "RESTARTING"
    spec: dict  # the spec with defaults filled and paths absolute (with the plan the head chose for plan: auto)
    submitted: Optional[datetime.datetime]
    updated: Optional[datetime.datetime]
    message: str  # why it is in this state
    actors: List[Actor]
    step: int  # the newest step every actor reported
    loss: float
    tokens_per_second: float
    predicted_step_seconds: float  # the planner's prediction (0: none)
    measured_step_seconds: float  # the newest step's
    restarts: int  # restarts from a checkpoint after faults
    attempt: int  # which run of the job the actors belong to (0: the first)
    faults: List[Fault]
    last_checkpoint_step: int  # the newest complete checkpoint (0: none)
    resumed_from: str  # the checkpoint the current run started from ("": a fresh start)
    submitted_parallel: dict  # the parallel section as submitted
    timed_compute: bool  # EMULATED: step times are emulated GPUs', the loss is not real
    precision: str  # what the actors train in: fp32, bf16 or fp16
    loss_scale: float  # fp16: the latest step's dynamic loss scale
    skipped_steps: int  # fp16: steps skipped because their gradients overflowed
    leaves: int = 0  # restarts without a worker that left on notice (a drain)
    replicas: Optional[Replicas] = None  # data-parallel replicas training now and planned
    regroups: int = 0  # times the job went on with fewer replicas without a restart
    heals: int = 0  # times a lost replica came back, its state streamed from a live one (no restart)
    heal_seconds: float = 0.0  # the latest heal: its fault's detection to the healed replica's first step

    @property
    def ended(self):
        """True once the job is SUCCEEDED, FAILED or CANCELLED (final states)."""
        return self.state in FINAL_STATES

    @staticmethod
    def from_proto(job):
        return _plain(JobStatus, job, state=enum_name(jobs_pb2.JobState, job.state, "JOB_"),
                      spec=message_to_dict(job.spec), submitted=_time(job.submitted_unix_ms),
                      updated=_time(job.updated_unix_ms), actors=[Actor.from_proto(a) for a in job.actors],
                      faults=[Fault.from_proto(f) for f in job.faults], replicas=Replicas.from_proto(job.replicas),
                      submitted_parallel=message_to_dict(job.submitted_parallel))


# ---- the cluster (geotrain.v1 cluster.proto) ----

@dataclass(frozen=True)
class Device(_Result):
    """A device a worker registered (geotrain.v1.Device)."""
    index: int
    kind: str  # "CPU", "CUDA", "EMULATED"
    name: str
    memory_bytes: int
    tflops: float  # measured (CPU GEMM probe, CUDA) or declared (emulated)
    timed_compute: bool  # emulated with timed compute
    compute_capability: int  # major * 10 + minor (75: T4); 0: a CPU
    fp32_tflops: float  # dense peak in each precision the device supports (0: not supported)
    fp16_tflops: float
    bf16_tflops: float
    slowdown: float = 0.0  # EMULATED when > 1: a CPU slowed by this factor (worker --slowdown); tflops divided by it

    @staticmethod
    def from_proto(device):
        return _plain(Device, device, kind=enum_name(cluster_pb2.DeviceKind, device.kind, "DEVICE_KIND_"))


@dataclass(frozen=True)
class Worker(_Result):
    """A worker of the cluster (geotrain.v1.Worker)."""
    worker_id: str
    site: str
    address: str  # advertised host:port that the head and peers dial
    listen_address: str
    devices: List[Device]
    state: str  # "ALIVE", "DEAD"
    registered: Optional[datetime.datetime]
    last_heartbeat: Optional[datetime.datetime]
    hostname: str
    pid: int
    incarnation: int  # raised each time this worker registers again
    metrics_address: str
    dead_reason: str
    address_for_site: Dict[str, str]  # addresses for peers at particular sites
    draining: bool = False  # leaving on notice (`geotrain worker drain`): nothing is placed on it

    @staticmethod
    def from_proto(worker):
        return _plain(Worker, worker, devices=[Device.from_proto(d) for d in worker.devices],
                      state=enum_name(cluster_pb2.WorkerState, worker.state, "WORKER_"),
                      registered=_time(worker.registered_unix_ms), last_heartbeat=_time(worker.last_heartbeat_unix_ms))


@dataclass(frozen=True)
class Site(_Result):
    """A site and what its alive workers hold (geotrain.v1.Site)."""
    name: str
    alive_workers: int
    dead_workers: int
    devices: int  # of alive workers
    tflops: float  # of alive workers' devices

    @staticmethod
    def from_proto(site):
        return _plain(Site, site)


@dataclass(frozen=True)
class SiteLink(_Result):
    """A link between two sites as the workers measured it (geotrain.v1.SiteLink)."""
    a: str
    b: str
    latency_ms: float  # one way: half the round trip
    bandwidth_mbps: float
    samples: int
    goodput_mbps: float  # tensor sends across the link in the last minute: acknowledged bytes over send time (0: none)

    @staticmethod
    def from_proto(link):
        return _plain(SiteLink, link)


@dataclass(frozen=True)
class ClusterStatus(_Result):
    """The cluster as the head sees it (geotrain.v1.ClusterStatus): what cluster() returns."""
    head_id: str  # changes when the head restarts
    head_address: str
    head_started: Optional[datetime.datetime]
    sites: List[Site]  # by name
    workers: List[Worker]
    actors: List[Actor]
    jobs_by_state: Dict[str, int]  # "PENDING", "RUNNING", ... -> count
    site_links: List[SiteLink]

    @property
    def alive_workers(self):
        """The workers whose state is "ALIVE"."""
        return [w for w in self.workers if w.state == "ALIVE"]

    @staticmethod
    def from_proto(status):
        return _plain(ClusterStatus, status, head_started=_time(status.head_started_unix_ms),
                      sites=[Site.from_proto(s) for s in status.sites],
                      workers=[Worker.from_proto(w) for w in status.workers],
                      actors=[Actor.from_proto(a) for a in status.actors],
                      site_links=[SiteLink.from_proto(link) for link in status.site_links])


# ---- the planner (geotrain.v1 planner.proto) ----

@dataclass(frozen=True)
class CrossSiteTraffic(_Result):
    """Bytes one plan sends between two sites per step, both directions, after compression."""
    site_a: str
    site_b: str
    bytes_per_step: float
    gradient_codec: str
    activation_codec: str

    @staticmethod
    def from_proto(traffic):
        return _plain(CrossSiteTraffic, traffic)


@dataclass(frozen=True)
class RankedPlan(_Result):
    """One plan of plan()'s ranking (geotrain.v1.RankedPlan)."""
    rank: int  # 1 is the plan a `plan: auto` job gets
    parallel: dict  # the spec's parallel section that runs this plan (plan: manual, dp, pp, ..., placement)
    predicted_step_seconds: float
    predicted_tokens_per_second: float
    pipeline_seconds: float  # forward and backward of every microbatch, slowest replica
    exposed_allreduce_seconds: float  # gradient all-reduce not hidden under backward
    bubble_fraction: float
    max_memory_fraction: float  # the fullest device's share of its usable memory
    devices: int  # devices the plan uses
    subset: str  # "all devices", "without site X", ...
    cross_site: List[CrossSiteTraffic]
    summary: str  # one line: "dp 2 x pp 2 x tp 1, 1f1b, 4 microbatches: 1.234 s/step"

    @staticmethod
    def from_proto(plan):
        return _plain(RankedPlan, plan, parallel=message_to_dict(plan.parallel),
                      cross_site=[CrossSiteTraffic.from_proto(t) for t in plan.cross_site])


@dataclass(frozen=True)
class PlanReply(_Result):
    """plan()'s answer (geotrain.v1.PlanJobReply)."""
    plans: List[RankedPlan]  # fastest first; plans[0] is what `plan: auto` runs
    explanation: List[str]  # why the first plan wins, a few lines
    plans_simulated: int
    planning_seconds: float
    alive_workers: int  # the cluster the plans are for
    devices: int

    @staticmethod
    def from_proto(reply):
        return _plain(PlanReply, reply, plans=[RankedPlan.from_proto(p) for p in reply.plans])


# ---- a job's step series as a table ----

STEP_COLUMNS = [f.name for f in dataclasses.fields(StepFigures) if f.name != "wan_bytes_by_pair"]


def steps_frame(steps):
    """A pandas DataFrame of step records (StepFigures, as client.steps() or a follower's .steps give them): one row
    per step in the order given, a column per field (val_loss NaN where not evaluated) and one per site pair,
    `wan_bytes[src>dst]` (0 where a step sent nothing that way). After a restart from a checkpoint, step numbers
    repeat: `frame.drop_duplicates("step", keep="last")` keeps the run that went on."""
    try:
        import pandas
    except ImportError:
        raise ImportError("steps_frame() needs pandas, which is not installed: `pip install pandas` (or `apt-get "
                          "install python3-pandas`), or use client.steps(job_id), the same figures as a list of "
                          "records") from None
    steps = list(steps)
    pairs = sorted({pair for s in steps for pair in s.wan_bytes_by_pair})
    rows = []
    for s in steps:
        row = [getattr(s, name) for name in STEP_COLUMNS]
        rows.append(row + [s.wan_bytes_by_pair.get(pair, 0) for pair in pairs])
    frame = pandas.DataFrame(rows, columns=STEP_COLUMNS + [f"wan_bytes[{pair}]" for pair in pairs])
    frame["val_loss"] = frame["val_loss"].astype(float)
    return frame
