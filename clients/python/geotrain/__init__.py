"""geotrain's Python client: submit, follow and plan training jobs on a geotrain cluster from Python or a notebook.

    import geotrain
    client = geotrain.Client()                 # GEOTRAIN_HEAD / GEOTRAIN_TOKEN(_FILE), else this machine's head
    job_id = client.submit("job.yaml")         # or a dict in the spec's shape
    for event in client.follow(job_id):        # until the job ends
        if event.step:
            print(event.step.step, event.step.loss, event.step.tokens_per_second)
        else:
            print(event)
    print(client.status(job_id).state)         # "SUCCEEDED"

    follower = client.follow(job_id, on_event=print)   # in the background: returns at once
    client.steps(job_id)                       # the step series: StepFigures records (steps_frame: a DataFrame)

It speaks the head's public API, geotrain.v1 (docs/api.md). The calls return plain Python (geotrain.results:
JobStatus, JobEvent, StepFigures, ClusterStatus, PlanReply, ...); each result's `.proto` is the message itself. The
modules generated from proto/ are geotrain.v1 (jobs_pb2, cluster_pb2, planner_pb2 and their *_pb2_grpc stubs) and
geotrain.spec_pb2 (JobSpec); the .proto files are in the package too (geotrain/proto/, proto_dir()).
"""
import os as _os

from geotrain._version import __version__
from geotrain.client import Client, state_name
from geotrain.endpoint import Endpoint, TlsFiles, resolve_head, resolve_tls
from geotrain.errors import (FailedPreconditionError, GeotrainError, InvalidArgumentError, NotFoundError,
                             UnauthenticatedError, UnavailableError)
from geotrain.follow import Follower
from geotrain.results import (FINAL_STATES, Actor, ClusterStatus, CrossSiteTraffic, Device, Fault, JobEvent, JobStatus,
                              PlanReply, RankedPlan, Replicas, Site, SiteLink, StepFigures, Worker, message_to_dict,
                              steps_frame)

# The names of earlier releases.
Event = JobEvent
Step = StepFigures


def proto_dir():
    """The directory of the public API's .proto files in this package (spec.proto, geotrain/v1/*.proto): a
    --proto_path for generating a client in another language, or for reading the API's comments."""
    return _os.path.join(_os.path.dirname(__file__), "proto")


__all__ = ["__version__", "Client", "state_name", "Follower", "JobStatus", "JobEvent", "StepFigures", "Fault",
           "Replicas", "Actor", "ClusterStatus", "Worker", "Device", "Site", "SiteLink", "PlanReply", "RankedPlan",
           "CrossSiteTraffic",
           "FINAL_STATES", "message_to_dict", "steps_frame", "Event", "Step", "proto_dir", "GeotrainError",
           "InvalidArgumentError", "NotFoundError", "FailedPreconditionError", "UnauthenticatedError",
           "UnavailableError", "Endpoint", "TlsFiles", "resolve_head", "resolve_tls"]
