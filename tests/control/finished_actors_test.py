"""A worker keeps no thread for an actor whose run has ended (real head and worker processes on loopback).

The worker keeps finished actors for their records (heartbeats, `actor list`); each used to keep its step reporter's
and checkpoint writer's threads too, so a long-lived worker gained two threads per actor and job (16 -> 28 after
three jobs, 2026-12-05). Six jobs of two actors each run one after the other on one two-device worker; its thread
count after the sixth is within a few of that after the second (gRPC's own pools grow a little with load), where
two threads per actor would add 16. Three jobs whose actors fail (missing data) leave none either.
Usage: finished_actors_test.py PATH/TO/geotrain
"""
import json
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from checkpoint_lib import write_shard  # noqa: E402
from cluster_lib import LocalCluster, wait_for  # noqa: E402

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"


def threads(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


class FinishedActorsTest(unittest.TestCase):
    worker_args = ()

    def setUp(self):
        self.c = LocalCluster(GEOTRAIN)
        self.addCleanup(self.c.close)
        self.c.start_head()
        self.worker = self.c.start_worker("w-1", "utah", ["T4", "T4"], self.worker_args)
        wait_for(lambda: list(self.c.worker_states().values()) == ["WORKER_ALIVE"], 20, "an alive worker")
        self.data = os.path.join(self.c.dir, "train_000000.bin")
        write_shard(self.data, np.random.default_rng(3).integers(0, 512, 20000))

    def run_job(self, i, data=None, state="JOB_SUCCEEDED"):
        path = os.path.join(self.c.dir, f"j{i}.yaml")
        with open(path, "w") as f:
            f.write(f"name: j{i}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data or self.data}'}}\n"
                    "train: {steps: 2, global_batch: 4, seq_len: 16}\n"
                    "parallel: {plan: manual, dp: 2, microbatches: 1}\n")
        job_id = self.c.cli(["job", "submit", path]).stdout.split()[1]
        self.c.cli(["job", "logs", job_id, "--follow"], check=False)
        job = json.loads(self.c.cli(["job", "status", job_id, "--json"]).stdout)
        self.assertEqual(job["state"], state, self.c.logs())
        self.assertEqual(len(job_actors(self.c, job_id)), 2, job)  # the worker ran two actors of it
        # The actors' runs are over once the worker lists them finished.
        wait_for(lambda: all(a["state"] == "ACTOR_DEAD" for a in job_actors(self.c, job_id)), 20,
                 f"job {job_id}'s actors to finish")

    def test_finished_actors_hold_no_threads(self):
        for i in range(2):  # gRPC's pools grow with the first jobs' load
            self.run_job(i)
        before = threads(self.worker.pid)
        for i in range(2, 6):
            self.run_job(i)
        after = threads(self.worker.pid)
        print(f"worker threads: {before} after the second job, {after} after the sixth", file=sys.stderr)
        # Four more jobs of two actors: 16 more threads at two per actor, 8 at one.
        self.assertLessEqual(after, before + 4, f"{before} threads after the second job, {after} after the sixth")
        # Actors that fail (their data is missing: a permanent error, no restart) end their threads too.
        for i in range(6, 9):
            self.run_job(i, data=os.path.join(self.c.dir, "missing_*.bin"), state="JOB_FAILED")
        failed = threads(self.worker.pid)
        print(f"worker threads: {failed} after three failed jobs", file=sys.stderr)
        self.assertLessEqual(failed, after + 4, f"{after} threads before three failed jobs, {failed} after")


class ForgottenActorsTest(FinishedActorsTest):
    """A worker forgets a finished actor --finished-actor-retention-ms after the head has its last report, and the
    head's job record keeps the actor's final state."""
    worker_args = ("--finished-actor-retention-ms", "1500")
    test_finished_actors_hold_no_threads = None

    def listed(self):
        """The ids of the actors the worker lists (through the head's registry of heartbeats)."""
        status = json.loads(self.c.cli(["status", "--json"]).stdout)
        return {a["actor_id"] if "actor_id" in a else a["actorId"] for a in status.get("actors", [])}

    def test_finished_and_failed_actors_are_forgotten_and_keep_their_final_state(self):
        self.run_job(0)
        self.run_job(1, data=os.path.join(self.c.dir, "missing_*.bin"), state="JOB_FAILED")
        jobs = {j["job_id"] if "job_id" in j else j["jobId"]: j
                for j in json.loads(self.c.cli(["job", "list", "--json"]).stdout).get("jobs", [])}
        self.assertEqual(len(jobs), 2, jobs)
        wait_for(lambda: not self.listed(), 30, "the worker to forget every finished actor")
        with open(os.path.join(self.c.dir, "worker-w-1.log")) as f:
            self.assertEqual(f.read().count("forgotten 1 s after it finished"), 4)
        for job_id, job in jobs.items():
            actors = job_actors(self.c, job_id)
            self.assertEqual(len(actors), 2, actors)
            for a in actors:
                self.assertEqual(a["state"], "ACTOR_DEAD", a)
                if job["state"] == "JOB_SUCCEEDED":
                    self.assertEqual(a["message"], "finished", a)
                else:
                    self.assertIn("missing_", a["message"], a)
        # The worker still runs jobs.
        self.run_job(2)


def job_actors(c, job_id):
    return json.loads(c.cli(["job", "status", job_id, "--json"]).stdout).get("actors", [])


if __name__ == "__main__":
    unittest.main()
