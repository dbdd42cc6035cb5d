"""DiLoCo across sites of unequal speed, with real head and worker processes.

Two sites on loopback, one worker each; site-b's worker is slowed 6x (`worker start --slowdown 6`: real numerics,
EMULATED times), far enough that the steps' noise on a busy machine never makes it the faster. A DiLoCo job paced by
time (`diloco: {sync: time}`) runs its first two steps count-paced, then lets site-a take more inner steps per step
than site-b; its step lines say so, and say that the times are emulated. Resumed from a checkpoint inside a period,
each group goes on from its own optimizer step and data position (site-a's are ahead of site-b's). `train --local`
refuses a time-paced job: one process cannot simulate the sites' times.

Usage: unequal_sites_test.py PATH/TO/geotrain
"""
import json
import os
import subprocess
import sys
import unittest

import numpy as np

from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.logs import cluster_steps
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"
STEPS, INNER, SLOWDOWN = 12, 4, 6


def spec_text(data, val, checkpoint=""):
    return (f"name: unequal\n{checkpoint}model: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data}', val: '{val}'}}\n"
            f"train: {{global_batch: 16, seq_len: 32, steps: {STEPS}, lr: 1.0e-3, warmup_steps: 2, "
            f"weight_decay: 0.1, grad_clip: 1.0, seed: 11, precision: fp32, eval_every: {STEPS}, eval_batches: 2}}\n"
            "parallel: {plan: manual, dp: 2, placement: [{replica: 0, site: site-a}, {replica: 1, site: site-b}]}\n"
            f"diloco: {{inner_steps: {INNER}, outer_lr: 0.7, outer_momentum: 0.9, codec: int8, sync: time}}\n")


class UnequalSitesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = c = LocalCluster(GEOTRAIN)
        rng = np.random.default_rng(7)
        data_dir = os.path.join(c.dir, "data")
        os.makedirs(data_dir)
        base = rng.integers(0, 512, size=97)
        tokens = np.concatenate([np.where(rng.random(97) < 0.1, rng.integers(0, 512, 97), base) for _ in range(400)])
        write_token_shard(os.path.join(data_dir, "train_000000.bin"), tokens)
        write_token_shard(os.path.join(data_dir, "val_000000.bin"), tokens[:3000])
        cls.data = (os.path.join(data_dir, "train_*.bin"), os.path.join(data_dir, "val_*.bin"))
        cls.spec = os.path.join(c.dir, "unequal.yaml")
        with open(cls.spec, "w") as f:
            f.write(spec_text(*cls.data))
        # One thread each: two workers on a machine of two cores (OpenMP's barriers would spin against each other),
        # so that each site's speed is its own and site-b stays the slower.
        c.env["OMP_NUM_THREADS"] = "1"
        c.start_head()
        c.start_worker("a0", "site-a")
        c.start_worker("b0", "site-b", extra_args=["--slowdown", str(SLOWDOWN)])
        wait_for(lambda: list(c.worker_states().values()).count("WORKER_ALIVE") == 2, 30, "two workers")

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    def test_slowed_worker_says_so(self):
        workers = {w["worker_id"]: w for w in self.c.status()["workers"]}
        slowed = workers["b0"]["devices"]
        self.assertTrue(slowed and all(d.get("slowdown") == SLOWDOWN for d in slowed), slowed)
        self.assertTrue(all(f"slowed {SLOWDOWN}x" in d["name"] for d in slowed), slowed)
        self.assertTrue(all(not d.get("slowdown") for d in workers["a0"]["devices"]), workers["a0"])

    def test_time_paced_job_lets_the_fast_site_take_more_inner_steps(self):
        out = self.c.cli(["job", "submit", self.spec, "--follow"], check=False)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr + self.c.logs())
        self.assertIn("SUCCEEDED", out.stdout)
        steps = cluster_steps(out.stdout)
        self.assertEqual([s["step"] for s in steps], list(range(1, STEPS + 1)), out.stdout)
        for s in steps:
            self.assertEqual(s["slowdown"], SLOWDOWN, s)  # a slowed worker took part: the times are emulated
            # The groups meet after step 2 (to plan the rest of the first period) and at every outer step, every INNER
            # steps (the time may print as 0.000).
            self.assertEqual(s["outer_sync_s"] is not None, s["step"] == 2 or s["step"] % INNER == 0, s)
            self.assertGreater(s["tokens_per_s"], 0, s)
        # Two steps count-paced; from then on site-a, six times as fast, takes more inner steps.
        self.assertTrue(all(s["inner_steps"] == 1 for s in steps[:2]), steps[:2])
        later = sum(s["inner_steps"] for s in steps[2:])
        self.assertGreater(later, STEPS - 2, f"site-a took no extra inner steps:\n{out.stdout}")
        self.assertLess(steps[-1]["loss"], steps[0]["loss"], out.stdout)
        self.assertIsNotNone(steps[-1]["val_loss"], out.stdout)

    def submit(self, name, checkpoint):
        path = os.path.join(self.c.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(spec_text(*self.data, checkpoint=f"checkpoint: {checkpoint}\n"))
        out = self.c.cli(["job", "submit", path, "--follow"], check=False)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr + self.c.logs())
        self.assertIn("SUCCEEDED", out.stdout)
        return out.stdout

    @staticmethod
    def manifest(ckpt, step):
        with open(os.path.join(ckpt, f"step_{step:08d}", "manifest.json")) as f:
            return json.load(f)

    def test_each_group_resumes_from_its_own_step_and_position(self):
        first = os.path.join(self.c.dir, "ckpt-first")
        self.submit("paced-first", f"{{dir: '{first}', every_steps: 6, keep: -1}}")
        at6 = self.manifest(first, 6)
        # Group 1 (site-b, the slowest) takes one inner step a job step; group 0 (site-a) at least as many.
        self.assertEqual(int(at6["group_optimizer_step"]["1"]), 6, at6)
        self.assertGreaterEqual(int(at6["optimizer_step"]), 6, at6)
        self.assertIn("1", at6.get("group_data_position", {}), at6)
        resumed = os.path.join(self.c.dir, "ckpt-resumed")
        out = self.submit("paced-resumed", f"{{dir: '{resumed}', every_steps: 12, "
                                           f"resume_from: '{os.path.join(first, 'step_00000006')}'}}")
        self.assertEqual([s["step"] for s in cluster_steps(out)], list(range(7, STEPS + 1)), out)
        # Group 1 went on from its own 6 (not group 0's count): 6 more steps of one inner step each.
        at12 = self.manifest(resumed, STEPS)
        self.assertEqual(int(at12["group_optimizer_step"]["1"]), STEPS, at12)

    def test_train_local_refuses_time_pacing(self):
        r = subprocess.run([GEOTRAIN, "train", "--local", self.spec], capture_output=True, text=True, timeout=60,
                           env=self.c.env)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn("diloco.sync time", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
