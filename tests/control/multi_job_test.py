"""Several jobs on one cluster, with real processes on loopback: a head and two one-device workers.

Two one-device jobs run side by side, one on each worker. A third job, submitted while both run, waits PENDING:
`job list` shows it queued (#1) with the reason (the devices it needs and which jobs hold them). A fourth job that
can never fit (four devices on a two-device cluster) waits too, queued behind the third, and its reason says how
many devices it needs. The first two are long enough never to end on their own during the test (so the queue is
the same on a fast machine); cancelling one frees its device, the third starts on it and ends SUCCEEDED while the
other still runs. Cancelling the rest works.
Usage: multi_job_test.py PATH/TO/geotrain
"""
import json
import os
import sys
import unittest

import numpy as np

from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"


class MultiJobTest(unittest.TestCase):
    def setUp(self):
        self.c = LocalCluster(GEOTRAIN)
        self.c.start_head()
        self.c.start_worker("w-1", "utah", ["T4"])
        self.c.start_worker("w-2", "utah", ["T4"])
        wait_for(lambda: list(self.c.worker_states().values()) == ["WORKER_ALIVE"] * 2, 20, "two alive workers")
        # One token shard (the format `geotrain data prepare` writes) of a tiny vocabulary.
        self.data = os.path.join(self.c.dir, "train_000000.bin")
        write_token_shard(self.data, np.random.default_rng(3).integers(0, 512, 20000))

    def tearDown(self):
        if hasattr(self, "_outcome") and not self._outcome.success:
            print(self.c.logs())
        self.c.close()

    def submit(self, name, steps, dp=1, data=None):
        path = os.path.join(self.c.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"name: {name}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data or self.data}'}}\n"
                    f"train: {{steps: {steps}, global_batch: 4, seq_len: 16}}\n"
                    f"parallel: {{plan: manual, dp: {dp}, microbatches: 1}}\n")
        out = self.c.cli(["job", "submit", path]).stdout
        return out.split()[1]

    def job(self, job_id):
        return json.loads(self.c.cli(["job", "status", job_id, "--json"]).stdout)

    def state(self, job_id):
        return self.job(job_id)["state"]

    def listing(self):
        """job list's table as {job id: (state, queue, message)}."""
        rows = {}
        for line in self.c.cli(["job", "list"]).stdout.splitlines()[1:]:
            parts = line.split(None, 6)
            queue = parts[3] if parts[3].startswith("#") else ""
            rows[parts[0]] = (parts[2], queue, line)
        return rows

    def test_two_jobs_side_by_side_then_a_third_that_waits(self):
        # Far more steps than the test lasts: they end only when cancelled.
        a = self.submit("first", 1000000)
        b = self.submit("second", 1000000)
        wait_for(lambda: self.state(a) == "JOB_RUNNING" and self.state(b) == "JOB_RUNNING", 60, "both jobs running")
        workers = {self.job(j)["actors"][0]["worker_id"] for j in (a, b)}
        self.assertEqual(workers, {"w-1", "w-2"}, "each job holds its own device")

        c = self.submit("third", 4)
        wait_for(lambda: "waiting for devices" in self.job(c).get("message", ""), 30, "the third job's reason")
        third = self.job(c)
        self.assertEqual(third["state"], "JOB_PENDING")
        self.assertIn("needs 1 device", third["message"])
        self.assertIn("held by", third["message"])
        row = self.listing()[c]
        self.assertEqual(row[0], "PENDING")
        self.assertEqual(row[1], "#1")
        self.assertIn("waiting for devices", row[2])

        never = self.submit("too-big", 4, dp=4)
        wait_for(lambda: "needs 4 devices" in self.job(never).get("message", ""), 30, "the big job's reason")
        rows = self.listing()
        self.assertEqual(rows[never][1], "#2", rows)
        self.assertEqual(rows[c][1], "#1", rows)

        # Cancelling the first frees its device: the third starts on it and ends, while the second still runs.
        self.c.cli(["job", "cancel", a])
        wait_for(lambda: self.state(a) == "JOB_CANCELLED", 30, "the first job cancelled")
        ended = wait_for(lambda: self.state(c) if self.state(c) not in ("JOB_PENDING", "JOB_RUNNING") else None, 120,
                         "the third job to end")
        self.assertEqual(ended, "JOB_SUCCEEDED", self.c.cli(["job", "logs", c]).stdout)
        log = self.c.cli(["job", "logs", c]).stdout
        self.assertLess(log.index("waiting for devices"), log.index("RUNNING"), log)
        self.assertEqual(self.job(c)["actors"][0]["worker_id"], self.job(a)["actors"][0]["worker_id"])
        self.assertEqual(self.state(b), "JOB_RUNNING")
        self.assertEqual(self.listing()[never][0], "PENDING")
        for j in (b, never):
            self.c.cli(["job", "cancel", j])
        wait_for(lambda: self.state(b) == "JOB_CANCELLED" and self.state(never) == "JOB_CANCELLED", 30,
                 "the second and the big job cancelled")

    def test_a_job_that_cannot_run_fails_without_restarts(self):
        # Data that is not there fails every run the same way: the job fails at once, with the fix, not after
        # fault_tolerance.max_restarts restarts.
        j = self.submit("no-data", 4, data=os.path.join(self.c.dir, "missing_*.bin"))
        ended = wait_for(lambda: self.job(j) if self.state(j) not in ("JOB_PENDING", "JOB_RUNNING") else None, 60,
                         "the job to fail")
        self.assertEqual(ended["state"], "JOB_FAILED")
        self.assertIn("no token shards match", ended["message"])
        self.assertIn("not restarted", ended["message"])
        self.assertEqual(int(ended["restarts"]), 0)


if __name__ == "__main__":
    unittest.main()
