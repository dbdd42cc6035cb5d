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

from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.shards import write_token_shard

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
        write_token_shard(self.data, np.random.default_rng(3).integers(0, 512, 20000))

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
        # The actors' runs are over once the worker lists both of them finished: its own word, from its heartbeats,
        # not the job's record.
        wait_for(lambda: [a["state"] for a in self.worker_actors().values() if a["job_id"] == job_id] ==
                 ["ACTOR_DEAD"] * 2, 20, f"the worker to list job {job_id}'s actors finished")
        return job_id

    def worker_actors(self):
        """The actors the worker lists in its heartbeats (the head's registry), by id."""
        status = json.loads(self.c.cli(["status", "--json"]).stdout)
        return {a["actor_id"]: a for a in status.get("actors", [])}

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
    worker_args = ("--finished-actor-retention-ms", "5000")  # long enough for run_job to see them finished
    test_finished_actors_hold_no_threads = None

    def test_finished_failed_and_cancelled_actors_are_forgotten_and_keep_their_final_state(self):
        succeeded = self.run_job(0)
        failed = self.run_job(1, data=os.path.join(self.c.dir, "missing_*.bin"), state="JOB_FAILED")
        # A job cancelled while it trains.
        path = os.path.join(self.c.dir, "long.yaml")
        with open(path, "w") as f:
            f.write(f"name: long\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{self.data}'}}\n"
                    "train: {steps: 100000, global_batch: 4, seq_len: 16}\n"
                    "parallel: {plan: manual, dp: 2, microbatches: 1}\n")
        cancelled = self.c.cli(["job", "submit", path]).stdout.split()[1]
        wait_for(lambda: int(json.loads(self.c.cli(["job", "status", cancelled, "--json"]).stdout).get("step", 0)) > 0, 60,
                 "the long job's first step")
        self.c.cli(["job", "cancel", cancelled])

        def forgotten():
            with open(os.path.join(self.c.dir, "worker-w-1.log")) as f:
                return f.read().count("forgotten 5000 ms after it finished")
        wait_for(lambda: forgotten() == 6, 30, "the worker to forget the six actors")
        wait_for(lambda: not self.worker_actors(), 10, "the worker's heartbeats to list no actor")
        for job_id, ended in ((succeeded, "finished"), (failed, None), (cancelled, "stopped")):
            actors = job_actors(self.c, job_id)
            self.assertEqual(len(actors), 2, actors)
            self.assertEqual({a["state"] for a in actors}, {"ACTOR_DEAD"}, actors)
            messages = [a["message"] for a in actors]
            if ended is None:
                # The actor that failed first keeps its own error; the head stopped the other one for it (or it
                # failed the same way).
                self.assertTrue(any(m.startswith("no token shards match") for m in messages), messages)
                self.assertTrue(all("missing_" in m for m in messages), messages)
            else:
                self.assertTrue(all(m.startswith(ended) for m in messages), messages)
        # The worker still runs jobs.
        self.run_job(3)


def job_actors(c, job_id):
    return json.loads(c.cli(["job", "status", job_id, "--json"]).stdout).get("actors", [])


if __name__ == "__main__":
    unittest.main()
