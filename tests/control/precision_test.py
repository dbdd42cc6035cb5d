"""Precision per job, with real processes on loopback: a head and workers with emulated Turing and Ampere GPUs.

Emulated devices take the real GPU's capabilities, so the CPU trains in the precision that GPU would (GEMM inputs
rounded as its tensor cores take them):
- bf16 asked of a job placed on an emulated RTX 6000 (compute capability 7.5) fails before any actor starts, with
  an error naming the device, its site and what it supports;
- precision auto on the RTX 6000s is fp16 with dynamic loss scaling: `job status --json` gives precision and
  loss_scale, the job log says why at the start, and the head exports geotrain_loss_scale and
  geotrain_skipped_steps_total;
- fp16 from a loss scale of 2^24 on DP2: the same steps overflow and are skipped as in `train --local`, whose losses
  the job equals; the skipped steps are counted in the job's status and metric;
- a job resumed from its checkpoint after the skips goes on at the scale it had and equals the uninterrupted run;
- on an emulated A30 (8.0) auto is bf16.
Usage: precision_test.py PATH/TO/geotrain
"""
import json
import os
import subprocess
import sys
import unittest
import urllib.request

import numpy as np

from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.logs import cluster_steps, local_steps
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"
STEPS = 12


class PrecisionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = LocalCluster(GEOTRAIN)
        cls.c.start_head()
        cls.c.start_worker("utah-0", "utah", ["RTX6000"])
        cls.c.start_worker("utah-1", "utah", ["RTX6000"])
        cls.c.start_worker("tacc-0", "tacc", ["A30"])
        wait_for(lambda: list(cls.c.worker_states().values()) == ["WORKER_ALIVE"] * 3, 30, "three alive workers")
        cls.data = os.path.join(cls.c.dir, "train_000000.bin")
        write_token_shard(cls.data, np.random.default_rng(5).integers(0, 512, 20000))

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    def spec(self, name, parallel, train_extra=""):
        path = os.path.join(self.c.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"name: {name}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{self.data}'}}\n"
                    f"train: {{steps: {STEPS}, global_batch: 4, seq_len: 16, lr: 1.0e-3, seed: 4{train_extra}}}\n"
                    f"parallel: {parallel}\ncomm: {{wan_codec: none}}\n")
        return path

    def run_job(self, path):
        out = self.c.cli(["job", "submit", path, "--follow"], check=False, timeout=300)
        job_id = out.stdout.split()[1]
        return job_id, out, json.loads(self.c.cli(["job", "status", job_id, "--json"]).stdout)

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.c.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def local_history(self, path):
        out = subprocess.run([GEOTRAIN, "train", "--local", path], capture_output=True, text=True, timeout=300,
                             env=self.c.env)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        steps = local_steps(out.stdout)
        self.assertEqual(len(steps), STEPS, out.stdout)
        return [s["loss"] for s in steps], [s["skipped"] for s in steps]

    def test_bf16_on_turing_is_refused_before_any_actor_starts(self):
        path = self.spec("bf16-on-turing", "{plan: manual, dp: 1, microbatches: 1, placement: [{replica: 0, "
                                           "stage: 0, site: utah}]}", ", precision: bf16")
        job_id, out, status = self.run_job(path)
        self.assertEqual(status["state"], "JOB_FAILED", out.stdout + out.stderr)
        self.assertRegex(status["message"], r"bf16 needs compute capability 8\.0; site utah's RTX6000 \(7\.5\) "
                                            r"supports fp16 and fp32")
        self.assertNotIn("actors created", self.c.cli(["job", "logs", job_id]).stdout)

    def test_auto_on_turing_is_fp16_with_loss_scaling_seen_everywhere(self):
        path = self.spec("auto-turing", "{plan: manual, dp: 2, microbatches: 1, placement: [{replica: 0, stage: 0, "
                                        "site: utah}, {replica: 1, stage: 0, site: utah}]}")
        job_id, out, status = self.run_job(path)
        self.assertEqual(status["state"], "JOB_SUCCEEDED", out.stdout + out.stderr + self.c.logs())
        self.assertEqual(status["precision"], "fp16")
        self.assertEqual(float(status["loss_scale"]), 65536)
        logs = self.c.cli(["job", "logs", job_id]).stdout
        self.assertIn("precision fp16 with dynamic loss scaling (auto: site utah's RTX6000 (7.5) has no bf16", logs)
        self.assertIn("precision fp16, loss scale 65536, 0 step(s) skipped",
                      self.c.cli(["job", "status", job_id]).stdout)
        text = self.metrics()
        self.assertRegex(text, rf'geotrain_loss_scale{{job_id="{job_id}"}} 65536')
        self.assertRegex(text, rf'geotrain_skipped_steps_total{{job_id="{job_id}"}} 0')

    def test_fp16_overflow_skips_the_steps_train_local_skips_and_equals_it(self):
        extra = ", precision: fp16, loss_scale: {initial: 16777216}"
        path = self.spec("overflow", "{plan: manual, dp: 2, microbatches: 1, placement: [{replica: 0, stage: 0, "
                                     "site: utah}, {replica: 1, stage: 0, site: utah}]}", extra)
        local_path = self.spec("overflow-local", "{plan: manual, dp: 2, microbatches: 1}", extra)
        losses, skipped = self.local_history(local_path)
        self.assertGreater(sum(skipped), 1)
        self.assertFalse(skipped[-1], "the scale came down to what fits: the last steps train")
        job_id, out, status = self.run_job(path)
        self.assertEqual(status["state"], "JOB_SUCCEEDED", out.stdout + out.stderr + self.c.logs())
        self.assertEqual(int(status.get("skipped_steps", 0)), sum(skipped))
        cluster = [s["loss"] for s in cluster_steps(out.stdout)]
        self.assertEqual(len(cluster), STEPS, out.stdout)
        for step, (a, b) in enumerate(zip(cluster, losses), 1):
            self.assertAlmostEqual(a, b, delta=1e-4 * b, msg=f"step {step}")
        self.assertRegex(self.metrics(), rf'geotrain_skipped_steps_total{{job_id="{job_id}"}} {sum(skipped)}')

    def test_a_resumed_fp16_job_restores_its_loss_scale(self):
        # From 2^24 with a checkpoint every step; resumed from the checkpoint after the skips, the job goes on at the
        # halved scale it had (not at 2^24, which would skip again) and ends as the uninterrupted one did.
        extra = ", precision: fp16, loss_scale: {initial: 16777216}"
        placement = "{plan: manual, dp: 1, microbatches: 1, placement: [{replica: 0, stage: 0, site: utah}]}"
        ckpt = os.path.join(self.c.dir, "ckpt-scale")
        path = self.spec("scale-full", placement, extra)
        with open(path, "a") as f:
            f.write(f"checkpoint: {{dir: '{ckpt}', every_steps: 1, keep: -1}}\n")
        job_id, out, status = self.run_job(path)
        self.assertEqual(status["state"], "JOB_SUCCEEDED", out.stdout + out.stderr + self.c.logs())
        skips = int(status.get("skipped_steps", 0))
        self.assertGreater(skips, 1)
        self.assertLess(skips, STEPS - 3, "steps after the skips train")
        full = [s["loss"] for s in cluster_steps(out.stdout)]
        resumed_path = self.spec("scale-resumed", placement, extra)
        middle = os.path.join(ckpt, f"step_{skips:08d}")
        out = self.c.cli(["job", "submit", resumed_path, "--follow", "--resume-from", middle], check=False,
                         timeout=300)
        resumed_id = out.stdout.split()[1]
        resumed = json.loads(self.c.cli(["job", "status", resumed_id, "--json"]).stdout)
        self.assertEqual(resumed["state"], "JOB_SUCCEEDED", out.stdout + out.stderr + self.c.logs())
        self.assertEqual(int(resumed.get("skipped_steps", 0)), 0, "the restored scale does not overflow again")
        self.assertEqual(float(resumed["loss_scale"]), float(status["loss_scale"]))
        again = [s["loss"] for s in cluster_steps(out.stdout)]
        self.assertEqual(len(again), STEPS - skips, out.stdout)
        for step, (a, b) in enumerate(zip(again, full[skips:]), skips + 1):
            self.assertAlmostEqual(a, b, delta=1e-5 * b, msg=f"step {step}")

    def test_auto_on_ampere_is_bf16(self):
        path = self.spec("auto-ampere", "{plan: manual, dp: 1, microbatches: 1, placement: [{replica: 0, stage: 0, "
                                        "site: tacc}]}")
        job_id, out, status = self.run_job(path)
        self.assertEqual(status["state"], "JOB_SUCCEEDED", out.stdout + out.stderr + self.c.logs())
        self.assertEqual(status["precision"], "bf16")
        self.assertEqual(float(status["loss_scale"]), 1)
        self.assertIn("precision bf16 (auto: every GPU of the job has compute capability 8.0 or more",
                      self.c.cli(["job", "logs", job_id]).stdout)


if __name__ == "__main__":
    unittest.main()
