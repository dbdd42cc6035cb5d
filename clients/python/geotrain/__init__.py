"""geotrain's Python client: submit, follow and plan training jobs on a geotrain cluster from Python or a notebook.

    import geotrain
    client = geotrain.Client()                 # GEOTRAIN_HEAD / GEOTRAIN_TOKEN(_FILE), else this machine's head
    job_id = client.submit("job.yaml")         # or a dict in the spec's shape
    for event in client.follow(job_id):        # until the job ends
        if event.step:
            print(event.step.step, event.step.loss, event.step.tokens_per_second)
        else:
            print(event)
    print(geotrain.state_name(client.status(job_id)))   # "SUCCEEDED"

It speaks the head's public API, geotrain.v1 (docs/api.md); the modules generated from proto/ are geotrain.v1
(jobs_pb2, cluster_pb2, planner_pb2 and their *_pb2_grpc stubs) and geotrain.spec_pb2 (JobSpec).
"""
from geotrain.client import Client, Event, Step, state_name
from geotrain.errors import (FailedPreconditionError, GeotrainError, InvalidArgumentError, NotFoundError,
                             UnauthenticatedError, UnavailableError)
from geotrain.endpoint import Endpoint, resolve_head

__all__ = ["Client", "Event", "Step", "state_name", "GeotrainError", "InvalidArgumentError", "NotFoundError",
           "FailedPreconditionError", "UnauthenticatedError", "UnavailableError", "Endpoint", "resolve_head"]
