"""Timed compute with real processes: `geotrain cluster up --timed-compute` (and `worker start --timed-compute`).

1. A DP2 job across two sites of a `cluster up --timed-compute` cluster of slow emulated T4s runs to the end: every
   actor's compute time per step is the wait that `geotrain model timed-step` predicts for the same shapes (within
   generous bounds), the step lines and `job status` say EMULATED and show no loss, the workers log that they emulate,
   and their /metrics carry geotrain_timed_compute 1.
2. The same job on real-compute workers sends exactly as many bytes across the sites per step: timed compute keeps
   every tensor's real size (gradient buckets through the real codec and streams).
3. A PP2 GPT-2 large job on timed H100 workers: each worker holds half of a 774 M-parameter model, whose weights,
   gradients and AdamW state would take about 6 GB per stage, in a few hundred MB (under 2 GB with sanitizers). A TP2 GPT-2 medium job on the
   same workers runs too (the tensor-parallel all-reduces after the emulated matmuls).

Usage: timed_compute_test.py PATH/TO/geotrain
"""
import json
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
import urllib.request

from geotrain_testing.clusters import ClusterUp, LocalCluster, pss_bytes, wait_for
from geotrain_testing.shards import write_tiny_corpus

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"

# A slow T4 (0.05 TFLOP/s peak): a step of the small test model waits about 0.2 s, far above the host's own work.
SLOW_T4 = "T4:0.05:16"
TOPOLOGY = """sites:
  - {name: site-a, workers: [{device: T4, tflops: 0.05, mem_gb: 16, count: 1}]}
  - {name: site-b, workers: [{device: T4, tflops: 0.05, mem_gb: 16, count: 1}]}
links:
  - {a: site-a, b: site-b, latency_ms: 2, bandwidth_mbps: 10000, jitter_ms: 0}
"""
STEP_LINE = re.compile(r"step (\d+) (EMULATED \(timed compute\) loss n/a|loss \S+) \d+ tokens/s step ([\d.]+) s "
                       r"\(compute ([\d.]+), comm wait ([\d.]+), bubble ([\d.]+)[^)]*\) wan bytes (\d+)")


def dp2_spec(directory, data):
    path = os.path.join(directory, "dp2.yaml")
    with open(path, "w") as f:
        f.write(f"name: dp2\nmodel: {{preset: gpt2-small-test}}\ndata: {{train: '{data}'}}\n"
                "train: {steps: 3, global_batch: 8, seq_len: 64}\n"
                "parallel: {plan: manual, dp: 2, microbatches: 1}\n")
    return path


def cluster_steps(log):
    return {int(m.group(1)): m for m in STEP_LINE.finditer(log)}


class TimedComputeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="geotrain_timed_")
        cls.data = write_tiny_corpus(os.path.join(cls.dir, "data"), vocab=512)
        cls.timed_steps = None

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)  # the corpus and specs; the clusters remove their own homes

    def test_1_dp2_waits_the_predicted_time_and_says_emulated(self):
        topology = os.path.join(self.dir, "topology.yaml")
        with open(topology, "w") as f:
            f.write(TOPOLOGY)
        c = ClusterUp(GEOTRAIN, topology, up_args=["--timed-compute"])
        try:
            self.assertIn("timed compute", c.up)
            job_id = c.cli(["job", "submit", dp2_spec(self.dir, self.data)]).stdout.split()[1]
            job = c.wait_job(job_id, 120)
            log = c.logs(job_id)
            self.assertEqual(job["state"], "JOB_SUCCEEDED", log + c.process_logs())
            self.assertTrue(job.get("timed_compute"), job)
            self.assertEqual(job.get("loss", 0), 0)
            self.assertIn("EMULATED", c.cli(["job", "status", job_id]).stdout)
            steps = cluster_steps(log)
            self.assertEqual(sorted(steps), [1, 2, 3], log)
            for m in steps.values():
                self.assertEqual(m.group(2), "EMULATED (timed compute) loss n/a", m.group(0))

            predicted = json.loads(c.cli(["model", "timed-step", "--model", "gpt2-small-test", "--device", SLOW_T4,
                                          "--batch", "4", "--seq-len", "64", "--json"]).stdout)["step_seconds"]
            self.assertGreater(predicted, 0.05)
            for step in (2, 3):  # step 1 also sets up streams
                m = steps[step]
                compute, total = float(m.group(4)), float(m.group(3))
                print(f"step {step}: compute {compute:.3f} s, step {total:.3f} s, predicted wait {predicted:.3f} s")
                # The waits are the prediction; the host's own work and the sleeps' overshoot add a little.
                self.assertGreaterEqual(compute, 0.95 * predicted, m.group(0))
                self.assertLessEqual(compute, 1.5 * predicted + 0.05, m.group(0))
                self.assertGreaterEqual(total, compute * 0.99, m.group(0))
            TimedComputeTest.timed_steps = {s: int(m.group(7)) for s, m in steps.items()}
            self.assertGreater(TimedComputeTest.timed_steps[2], 0)

            logs = c.process_logs()
            self.assertIn("EMULATES a T4", logs)
            self.assertIn("step times are EMULATED", logs)
            status = json.loads(c.cli(["status", "--json"]).stdout)
            for w in status["workers"]:
                with urllib.request.urlopen(f"http://{w['metrics_address']}/metrics", timeout=10) as r:
                    metrics = r.read().decode()
                self.assertRegex(metrics, r'geotrain_timed_compute\{site="site-[ab]"\} 1', w["worker_id"])
        except Exception:
            print(c.process_logs())
            raise
        finally:
            c.close()

    def test_2_real_compute_sends_the_same_bytes(self):
        if TimedComputeTest.timed_steps is None:
            self.skipTest("the timed run failed")
        c = LocalCluster(GEOTRAIN)
        try:
            c.start_head()
            c.start_worker("w-a", "site-a", [SLOW_T4])
            c.start_worker("w-b", "site-b", [SLOW_T4])
            wait_for(lambda: sorted(c.worker_states().values()) == ["WORKER_ALIVE"] * 2, 30, "two workers")
            job_id = c.cli(["job", "submit", dp2_spec(c.dir, self.data)]).stdout.split()[1]
            wait_for(lambda: json.loads(c.cli(["job", "status", job_id, "--json"]).stdout)["state"]
                     in ("JOB_SUCCEEDED", "JOB_FAILED"), 120, "the real-compute job")
            job = json.loads(c.cli(["job", "status", job_id, "--json"]).stdout)
            log = c.cli(["job", "logs", job_id]).stdout
            self.assertEqual(job["state"], "JOB_SUCCEEDED", log + c.logs())
            self.assertFalse(job.get("timed_compute", False))
            steps = cluster_steps(log)
            self.assertTrue(all(m.group(2).startswith("loss ") for m in steps.values()), log)
            real = {s: int(m.group(7)) for s, m in steps.items()}
            print(f"WAN bytes per step: timed {TimedComputeTest.timed_steps}, real {real}")
            self.assertEqual(real, TimedComputeTest.timed_steps)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.close()

    def test_3_gpt2_large_pp2_holds_no_weights(self):
        c = LocalCluster(GEOTRAIN)
        try:
            c.start_head()
            # Timed compute needs a device to emulate, and a bandwidth for it.
            for devices, why in (([], "needs the devices to emulate"), (["--emulate-device", "X1:50:16"], "BW_GBS")):
                bad = c.cli(["worker", "start", "--site", "x", "--metrics-port", "-1", "--timed-compute"] + devices,
                            check=False, timeout=30)
                self.assertNotEqual(bad.returncode, 0)
                self.assertIn(why, bad.stderr + bad.stdout)
            workers = [c.start_worker(f"w-{i}", "site-a", ["H100"], ["--timed-compute"]) for i in range(2)]
            wait_for(lambda: sorted(c.worker_states().values()) == ["WORKER_ALIVE"] * 2, 30, "two workers")
            path = os.path.join(c.dir, "large.yaml")
            with open(path, "w") as f:
                f.write(f"name: large\nmodel: {{preset: gpt2-large}}\ndata: {{train: '{self.data}'}}\n"
                        "train: {steps: 4, global_batch: 2, seq_len: 64}\n"
                        "parallel: {plan: manual, pp: 2, microbatches: 2}\n")
            job_id = c.cli(["job", "submit", path]).stdout.split()[1]
            peak = 0
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                peak = max([peak] + [pss_bytes(p.pid) for p in workers])
                state = json.loads(c.cli(["job", "status", job_id, "--json"]).stdout)["state"]
                if state in ("JOB_SUCCEEDED", "JOB_FAILED"):
                    break
                time.sleep(0.2)
            log = c.cli(["job", "logs", job_id]).stdout
            self.assertEqual(state, "JOB_SUCCEEDED", log + c.logs())
            self.assertEqual(sorted(cluster_steps(log)), [1, 2, 3, 4], log)
            print(f"peak worker PSS {peak / 1e6:.0f} MB (a real stage would hold about 6 GB)")
            self.assertGreater(peak, 0)
            # A real stage: about 6 GB of state. The timed one: the runtime's buffers (the tied embedding's 257 MB
            # all-reduce dominates; sanitizer builds add their quarantine and shadow).
            self.assertLess(peak, 2 << 30)

            # Tensor parallelism: the activations' all-reduces go through the real TP communicator, after the
            # emulated matmuls that produce them.
            with open(path, "w") as f:
                f.write(f"name: tp2\nmodel: {{preset: gpt2-medium}}\ndata: {{train: '{self.data}'}}\n"
                        "train: {steps: 3, global_batch: 2, seq_len: 64}\n"
                        "parallel: {plan: manual, tp: 2, microbatches: 1}\n")
            tp_job = c.cli(["job", "submit", path]).stdout.split()[1]
            wait_for(lambda: json.loads(c.cli(["job", "status", tp_job, "--json"]).stdout)["state"]
                     in ("JOB_SUCCEEDED", "JOB_FAILED"), 120, "the TP2 job")
            tp_log = c.cli(["job", "logs", tp_job]).stdout
            self.assertEqual(json.loads(c.cli(["job", "status", tp_job, "--json"]).stdout)["state"], "JOB_SUCCEEDED",
                             tp_log + c.logs())
            self.assertEqual([m.group(2) for m in cluster_steps(tp_log).values()],
                             ["EMULATED (timed compute) loss n/a"] * 3, tp_log)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
