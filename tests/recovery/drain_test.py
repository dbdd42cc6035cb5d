"""Workers that leave on notice (a drain), with real processes: a head and two workers on loopback, one with one
device (w-1) and one with two (w-2), so that a DP2 job has a replica on each and fits on w-2 alone.

- `geotrain worker drain w-1` mid-job (`fault_tolerance.regroup: false`): every actor leaves after one step T with a
  checkpoint of T, the job restarts on w-2 from T and ends SUCCEEDED; its step events are 1..N, each exactly once
  (nothing lost, nothing trained again); the final weights equal those of the same job run uninterrupted; the log says
  each part in one line; `job status --json` counts one leave and no fault; the drained worker exits 0 by itself.
- SIGTERM to a worker (started again) in a second job without checkpoint.dir, live regroups on (the default): the
  replica on that worker leaves after one step T and the other trains on without a restart (a leave by regroup);
  every step once, one leave, one regroup, no fault; the final weights equal the one-process simulation that trains
  the kept replica alone from T + 1; the worker exits 0 by itself once its actors are gone.

It prints the drain's cost (from the drain request to the first step after the restart) for docs/reliability.md.
Usage: drain_test.py PATH/TO/geotrain
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import unittest

import numpy as np

from geotrain_testing.checkpoints import newest, read_step_dir
from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1)
VOCAB = 512
STEPS = 150


def spec_text(name, data, ckpt, parallel, steps=STEPS, extra=""):
    checkpoint = f"checkpoint: {{dir: '{ckpt}', keep: -1}}\n" if ckpt else ""
    return (f"name: {name}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data}'}}\n"
            f"train: {{global_batch: 8, seq_len: 16, steps: {steps}, lr: 1.0e-3, warmup_steps: 2, "
            f"weight_decay: 0.1, grad_clip: 1.0, seed: 11, precision: fp32}}\n"
            f"parallel: {parallel}\ncomm: {{wan_codec: none, grad_bucket_mb: 0.002}}\n{checkpoint}{extra}")


RESTART = "fault_tolerance: {regroup: false}\n"  # a drain restarts the job without the worker
NO_HEAL = "fault_tolerance: {heal: false}\n"  # the replica that left stays away (its simulation has it leave)


DP2 = "{plan: manual, dp: 2, microbatches: 2}"


class DrainTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = LocalCluster(GEOTRAIN)
        cls.work = os.path.join(cls.c.dir, "work")
        os.makedirs(cls.work)
        rng = np.random.default_rng(5)
        base = rng.integers(0, VOCAB, size=97)
        tokens = np.concatenate([np.where(rng.random(97) < 0.1, rng.integers(0, VOCAB, 97), base) for _ in range(400)])
        write_token_shard(os.path.join(cls.work, "train_000000.bin"), tokens)
        cls.data = os.path.join(cls.work, "train_*.bin")
        cls.c.start_head()
        cls.start_worker("w-1", ["T4"])
        cls.start_worker("w-2", ["T4", "T4"])

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    @classmethod
    def start_worker(cls, name, devices):
        worker = cls.c.start_worker(name, "site-a", devices)
        wait_for(lambda: cls.c.worker_states().get(name) == "WORKER_ALIVE"
                 and not cls.worker(name).get("draining"), 30, f"{name} alive", 0.3)
        return worker

    @classmethod
    def worker(cls, name):
        return next((w for w in cls.c.status()["workers"] if w["worker_id"] == name), {})

    def write_spec(self, name, ckpt, parallel=DP2, steps=STEPS, extra=""):
        path = os.path.join(self.work, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(spec_text(name, self.data, ckpt, parallel, steps, extra))
        return path

    def job(self, job_id):
        return json.loads(self.c.cli(["job", "status", job_id, "--json"]).stdout)

    def logs(self, job_id):
        return self.c.cli(["job", "logs", job_id]).stdout

    def wait_step(self, job_id, step):
        wait_for(lambda: int(self.job(job_id).get("step", 0)) >= step, 120, f"{job_id} at step {step}", 0.2)

    def wait_end(self, job_id):
        self.c.cli(["job", "logs", job_id, "--follow"], check=False, timeout=600)
        job = self.job(job_id)
        if job["state"] != "JOB_SUCCEEDED":
            self.fail(f"{job_id}: {job['state']}: {job['message']}\n{self.logs(job_id)}\n{self.c.logs()}")
        return job

    def step_events(self, job_id):
        """The job's step events: (step, unix_ms) in the order the head recorded them."""
        out = self.c.cli(["job", "logs", job_id]).stdout
        self.assertNotIn("\n\n", out)
        events = []
        for line in out.splitlines():
            m = re.match(r"\S+ \S+ step (\d+) ", line)
            if m:
                events.append(int(m.group(1)))
        return events

    def expect_drained(self, job_id, worker, requested, expect_dir):
        """The job left `worker` at one step T with a checkpoint of T in `expect_dir`, restarted on w-2 from T and
        succeeded with every step trained once. Returns T and the drain's cost in seconds."""
        job = self.wait_end(job_id)
        logs = self.logs(job_id)
        self.assertEqual(int(job.get("leaves", 0)), 1, logs)
        self.assertEqual(int(job.get("restarts", 0)), 0, logs)  # a leave is no fault
        self.assertFalse(job.get("faults"), logs)
        m = re.search(rf"worker {worker} drains: its actors leave at step (\d+)", logs)
        self.assertTrue(m, logs)
        self.assertRegex(logs, rf"RESTARTING: worker {worker} drains: checkpoint at step \d+ committed; "
                               rf"restarting without {worker}")
        target = int(re.search(r"checkpoint at step (\d+) committed", logs).group(1))
        self.assertGreaterEqual(target, int(m.group(1)))  # a later step when an actor passed the first unaware
        self.assertRegex(logs, rf"restarted \(run 1\) from {re.escape(expect_dir)}/step_{target:08d} at step {target}")
        self.assertIn(f"training again without {worker}", logs)
        self.assertIn("no step lost", logs)
        self.assertTrue(os.path.isfile(os.path.join(expect_dir, f"step_{target:08d}", "manifest.json")))
        # Every step trained exactly once: 1..T by the first run, T+1..N by the second.
        self.assertEqual(self.step_events(job_id), list(range(1, STEPS + 1)))
        # The second run's actors (ids "...-a1") are all on w-2.
        self.assertEqual({a["worker_id"] for a in job["actors"] if a["actor_id"].endswith("-a1")}, {"w-2"},
                         job["actors"])
        cost = float(re.search(r"training again without \S+ ([\d.]+) s after the drain began", logs).group(1))
        print(f"drain of {worker}: the actors left at step {target} (first target {m.group(1)}); training again "
              f"{cost:.1f} s after the drain began; {time.time() - requested:.1f} s from the request to the job's end")
        return target, cost

    def test_1_drain_from_the_cli_mid_job(self):
        # The reference: the same job uninterrupted on the same workers, which sums each step's gradients as the
        # drained job does (`train --local` sums them in another order and drifts from both by 3e-5 in 300 steps).
        reference_ckpt = os.path.join(self.work, "ckpt-reference")
        reference_id = self.c.cli(["job", "submit", self.write_spec("reference", reference_ckpt, extra=RESTART)]
                                  ).stdout.split()[1]
        self.wait_end(reference_id)
        ckpt = os.path.join(self.work, "ckpt-cli")
        job_id = self.c.cli(["job", "submit", self.write_spec("drain-cli", ckpt, extra=RESTART)]).stdout.split()[1]
        self.wait_step(job_id, 3)
        self.assertEqual({a["worker_id"] for a in self.job(job_id)["actors"]}, {"w-1", "w-2"})
        requested = time.time()
        r = self.c.cli(["worker", "drain", "w-1", "--wait"], timeout=300)
        self.assertIn("w-1 drains", r.stdout)
        self.assertIn("w-1 drained", r.stdout)
        # The drained worker exits 0 by itself once its actors are gone.
        proc = self.c.workers["w-1"]
        self.assertEqual(proc.wait(timeout=60), 0, self.c.logs())
        target, cost = self.expect_drained(job_id, "w-1", requested, ckpt)
        self.assertEqual(self.metric("geotrain_job_leaves_total", job_id), 1.0)
        # Nothing lost: the final weights are the uninterrupted run's.
        reference = read_step_dir(newest(reference_ckpt))[1]
        step, params = read_step_dir(newest(ckpt))
        self.assertEqual(step, STEPS)
        self.assertEqual(sorted(params), sorted(reference))
        worst = max(float(np.max(np.abs(params[k] - ref))) for k, ref in reference.items())
        self.assertLessEqual(worst, 1e-6, "the drained job's final weights differ from the uninterrupted job's")
        print(f"DRAIN_COST cli {cost:.2f} s (step {target}); final weights equal the uninterrupted job's "
              f"(worst difference {worst:.1e})")

    def metric(self, name, job_id):
        import urllib.request  # noqa: PLC0415
        with urllib.request.urlopen(f"http://127.0.0.1:{self.c.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(rf'^{name}{{job_id="{job_id}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else None

    def test_2_sigterm_drains_and_the_other_replica_trains_on_without_a_restart(self):
        proc = self.start_worker("w-1", ["T4"])  # a new process: it joins afresh, not draining
        out = self.c.cli(["job", "submit", self.write_spec("drain-sigterm", None, extra=NO_HEAL)]).stdout
        job_id = out.split()[1]
        self.wait_step(job_id, 3)
        actors = self.job(job_id)["actors"]
        self.assertEqual({a["worker_id"] for a in actors}, {"w-1", "w-2"})
        left_replica = next(a.get("replica", 0) for a in actors if a["worker_id"] == "w-1")
        kept = 1 - left_replica
        requested = time.time()
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(proc.wait(timeout=120), 0, self.c.logs())
        left = time.time() - requested
        # Its actor leaves at T, not after a collective's 60 s deadline (as when it missed the new membership).
        self.assertLess(left, 30.0, self.c.logs())
        job = self.wait_end(job_id)
        logs = self.logs(job_id)
        self.assertEqual(int(job.get("leaves", 0)), 1, logs)
        self.assertEqual(int(job.get("regroups", 0)), 1, logs)
        self.assertEqual(int(job.get("restarts", 0)), 0, logs)
        self.assertFalse(job.get("faults"), logs)
        self.assertEqual(job["replicas"], {"present": 1, "planned": 2}, logs)
        self.assertNotIn("RESTARTING", logs)
        self.assertRegex(logs, rf"worker w-1 drains: the replicas with an actor there leave after step \d+; replicas "
                               rf"{kept} train on without a restart")
        target = int(re.search(r"regrouped: replicas \d+ rebuilt their groups at step (\d+)", logs).group(1))
        self.assertIn(f"worker w-1 drains: its replicas left after step {target}; the job goes on without a restart",
                      logs)
        self.assertEqual(self.step_events(job_id), list(range(1, STEPS + 1)), logs)
        pause = float(re.search(r"stayed healthy paused ([\d.]+) s", logs).group(1))
        self.assertEqual(self.metric("geotrain_job_leaves_total", job_id), 1.0)
        self.assertEqual(self.metric("geotrain_job_regroups_total", job_id), 1.0)
        self.assertEqual(self.metric("geotrain_job_replicas", job_id), 1.0)
        # The final weights: the one-process simulation of both replicas to T, then replica `kept` alone.
        head_dir = os.path.join(self.c.state_dir, "checkpoints", job_id)
        local_ckpt = os.path.join(self.work, "local-left")
        path = self.write_spec("local-left", local_ckpt)
        out = subprocess.run([GEOTRAIN, "train", "--local", path, "--regrouped-at", str(target + 1), "--replicas",
                              str(kept)], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr + out.stdout)
        step, params = read_step_dir(newest(head_dir))
        self.assertEqual(step, STEPS)
        simulated = read_step_dir(newest(local_ckpt))[1]
        worst = max(float(np.max(np.abs(params[k] - v))) / max(1.0, float(np.max(np.abs(v))))
                    for k, v in simulated.items())
        self.assertLessEqual(worst, 5e-5, "the job's weights differ from the simulation without the drained replica")
        print(f"LEAVE_BY_REGROUP sigterm: replica {left_replica} left after step {target}, replica {kept} trained on; "
              f"the healthy replica paused {pause:.2f} s; the worker exited {left:.1f} s after SIGTERM; weights "
              f"equal the simulation (worst relative difference {worst:.1e})")


if __name__ == "__main__":
    unittest.main(verbosity=2)
