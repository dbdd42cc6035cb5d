"""Distributed training equals single-process training.

Real head and worker processes on loopback (two sites) train a tiny GPT-2 with DP=2, PP=2 (GPipe and
1F1B), TP=2 and DP=2 x PP=2 across the sites; every step's loss and the final parameters must equal
`geotrain train --local` on the same spec to 1e-5 relative (fp32; only the order of reductions differs).
With bf16 and int8 WAN codecs, 100 steps end within 2% of the lossless loss, and the bytes that cross
sites shrink by the codec's ratio, as measured by the actors' own counters. DiLoCo across the sites equals its
simulation, with validation loss and resumed from a synchronous job's checkpoint (a warm start); resumed from
its own checkpoint, it goes on as the uninterrupted job did.

Usage: equivalence_test.py PATH/TO/geotrain
"""
import json
import os
import re
import subprocess
import sys
import unittest

import numpy as np

from geotrain_testing.checkpoints import newest, read_safetensors
from geotrain_testing.clusters import LocalCluster, wait_for
from geotrain_testing.logs import cluster_steps, local_steps
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"
VOCAB = 512


def read_checkpoint(ckpt, steps):
    """The weights of the newest checkpoint under ckpt (which must be of `steps`), from every model file."""
    step_dir = newest(ckpt)
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    assert int(manifest["step"]) == steps, manifest["step"]
    params = {}
    for name in sorted(set(manifest["tensors"].values())):  # group 0's files (DiLoCo groups have their own)
        params.update(read_safetensors(os.path.join(step_dir, name)))
    return params


def spec_text(name, data_glob, ckpt, steps, parallel, codec="none", lr="1.0e-3"):
    return (f"name: {name}\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data_glob}'}}\n"
            f"train: {{global_batch: 8, seq_len: 16, steps: {steps}, lr: {lr}, warmup_steps: 2, "
            f"weight_decay: 0.1, grad_clip: 1.0, seed: 11, precision: fp32}}\n"
            f"parallel: {parallel}\ncomm: {{wan_codec: '{codec}', grad_bucket_mb: 0.002}}\n"
            f"checkpoint: {{dir: '{ckpt}', every_steps: 0}}\n")


class EquivalenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = LocalCluster(GEOTRAIN)
        c = cls.c
        rng = np.random.default_rng(5)
        data_dir = os.path.join(c.dir, "data")
        os.makedirs(data_dir)
        # Token streams with structure (a noisy repeating pattern) so that the loss moves.
        base = rng.integers(0, VOCAB, size=97)
        tokens = np.concatenate([np.where(rng.random(97) < 0.1, rng.integers(0, VOCAB, 97), base) for _ in range(400)])
        write_token_shard(os.path.join(data_dir, "train_000000.bin"), tokens)
        cls.data = os.path.join(data_dir, "train_*.bin")
        write_token_shard(os.path.join(data_dir, "val_000000.bin"), tokens[:3000])
        cls.val = os.path.join(data_dir, "val_*.bin")
        c.start_head()
        for name, site in (("a0", "site-a"), ("a1", "site-a"), ("b0", "site-b"), ("b1", "site-b")):
            c.start_worker(name, site, ["T4"])
        wait_for(lambda: list(c.worker_states().values()).count("WORKER_ALIVE") == 4, 30, "four workers")
        cls.local = {}

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    def local_run(self, steps, microbatches):
        key = (steps, microbatches)
        if key not in self.local:
            ckpt = os.path.join(self.c.dir, f"local-{steps}-{microbatches}")
            path = os.path.join(self.c.dir, f"local-{steps}-{microbatches}.yaml")
            with open(path, "w") as f:
                f.write(spec_text("local", self.data, ckpt, steps,
                                  f"{{plan: manual, microbatches: {microbatches}}}"))
            out = subprocess.run([GEOTRAIN, "train", "--local", path], capture_output=True, text=True,
                                 timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr + out.stdout)
            losses = [s["loss"] for s in local_steps(out.stdout)]
            self.assertEqual(len(losses), steps, out.stdout)
            final = os.path.join(ckpt, f"step_{steps:08d}", "model.safetensors")
            self.local[key] = (losses, read_safetensors(final))
        return self.local[key]

    def distributed_run(self, name, steps, parallel, codec="none"):
        c = self.c
        ckpt = os.path.join(c.dir, f"ckpt-{name}")
        path = os.path.join(c.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(spec_text(name, self.data, ckpt, steps, parallel, codec))
        out = c.cli(["job", "submit", path, "--follow"], check=False)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr + c.logs())
        self.assertIn("SUCCEEDED", out.stdout)
        losses, wan = [], 0
        for s in cluster_steps(out.stdout):
            losses.append(s["loss"])
            wan += s["wan_bytes"]
        self.assertEqual(len(losses), steps, out.stdout)
        return losses, read_checkpoint(ckpt, steps), wan, out.stdout

    def check_equal(self, name, parallel, microbatches):
        steps = 6
        ref_losses, ref_params = self.local_run(steps, microbatches)
        losses, params, _, log = self.distributed_run(name, steps, parallel)
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            # The log prints 6 decimals; the bound is 1e-5 relative or the printed precision.
            self.assertLessEqual(abs(a - b), max(1e-5 * abs(b), 1.5e-6), f"{name} step {i + 1}: {a} vs {b}")
        self.assertEqual(sorted(params), sorted(ref_params), name)
        worst = 0.0
        for k, ref in ref_params.items():
            diff = float(np.max(np.abs(params[k] - ref)))
            bound = 1e-5 * max(1.0, float(np.max(np.abs(ref))))
            worst = max(worst, diff / max(1.0, float(np.max(np.abs(ref)))))
            self.assertLessEqual(diff, bound, f"{name}: {k} differs by {diff}")
        print(f"{name}: {steps} steps, losses equal; worst relative parameter difference {worst:.2e}")

    def test_dp2(self):
        self.check_equal("dp2", "{plan: manual, dp: 2, microbatches: 2}", 4)
        # grad_bucket_mb 0.002 puts each block in its own bucket: the all-reduce overlapped backward.
        logs = ""
        for name in os.listdir(self.c.dir):
            if name.endswith(".log"):
                with open(os.path.join(self.c.dir, name), errors="replace") as f:
                    logs += f.read()
        buckets = [int(n) for n in re.findall(r"gradient all-reduce in (\d+) buckets", logs)]
        self.assertTrue(buckets and max(buckets) >= 3, f"bucket counts in the worker logs: {buckets}")

    def test_pp2_gpipe(self):
        self.check_equal("pp2-gpipe", "{plan: manual, pp: 2, microbatches: 4, schedule: gpipe}", 4)

    def test_pp2_1f1b(self):
        self.check_equal("pp2-1f1b", "{plan: manual, pp: 2, microbatches: 4, schedule: 1f1b}", 4)

    def test_tp2(self):
        self.check_equal("tp2", "{plan: manual, tp: 2, microbatches: 2}", 2)

    def test_dp2_pp2_two_sites(self):
        self.check_equal("dp2pp2", "{plan: manual, dp: 2, pp: 2, microbatches: 2, schedule: 1f1b}", 4)

    def test_validation_loss_and_diloco_across_sites(self):
        # Real head and workers: DiLoCo with one replica per site (inner_steps 2, Nesterov momentum, exact
        # pseudo-gradients, the inner rate scaled by 1.5) and validation every 2 steps. The head's log (mean of the
        # replicas' losses and validation losses) equals `train --local`'s simulation of the same spec.
        steps = 6
        text = spec_text("diloco-val", self.data, os.path.join(self.c.dir, "ckpt-diloco"), steps,
                         "{plan: manual, dp: 2, microbatches: 2, "
                         "placement: [{replica: 0, site: site-a}, {replica: 1, site: site-b}]}")
        text = text.replace(f"data: {{train: '{self.data}'}}", f"data: {{train: '{self.data}', val: '{self.val}'}}")
        text = text.replace("seed: 11}", "seed: 11, eval_every: 2, eval_batches: 2}")
        text += "diloco: {inner_steps: 2, outer_lr: 0.7, outer_momentum: 0.9, codec: none, inner_lr_scale: 1.5}\n"
        path, local_path = os.path.join(self.c.dir, "diloco-val.yaml"), os.path.join(self.c.dir, "diloco-local.yaml")
        with open(path, "w") as f:
            f.write(text)
        with open(local_path, "w") as f:  # its own checkpoints: the cluster job must not resume from them
            f.write(text.replace("ckpt-diloco", "ckpt-diloco-local"))
        local = subprocess.run([GEOTRAIN, "train", "--local", local_path], capture_output=True, text=True, timeout=300)
        self.assertEqual(local.returncode, 0, local.stderr + local.stdout)
        self.assertIn("DiLoCo simulated: 2 replicas in 2 groups", local.stdout)
        self.assertIn("inner lr x 1.5 (at most train.lr)", local.stdout)
        ref = {s["step"]: (s["loss"], s["val_loss"]) for s in local_steps(local.stdout)}
        out = self.c.cli(["job", "submit", path, "--follow"], check=False)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr + self.c.logs())
        got = {s["step"]: (s["loss"], s["val_loss"]) for s in cluster_steps(out.stdout)}
        self.assertEqual(sorted(got), list(range(1, steps + 1)), out.stdout)
        for step, (loss, val) in got.items():
            want_loss, want_val = ref[step]
            # train --local prints 4 decimals: the bound is 1e-5 relative or that precision.
            self.assertLessEqual(abs(loss - want_loss), max(1e-5 * want_loss, 5.1e-5), f"step {step}")
            self.assertEqual(val is None, want_val is None, f"step {step}: validation on one side only")
            if val is not None:
                self.assertLessEqual(abs(val - want_val), max(1e-5 * want_val, 5.1e-5), f"validation, step {step}")
        print(f"diloco-val: {steps} steps, losses and validation losses equal to the simulation's")

    def submit_for_losses(self, name, spec, steps):
        """Submits the spec, follows the job to its end and returns its loss by step, which must be `steps`."""
        path = os.path.join(self.c.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(spec)
        out = self.c.cli(["job", "submit", path, "--follow"], check=False)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr + self.c.logs())
        losses = {s["step"]: s["loss"] for s in cluster_steps(out.stdout)}
        self.assertEqual(sorted(losses), list(steps), out.stdout)
        return losses

    def assert_same_final_weights(self, got_ckpt, want_ckpt, steps):
        """The newest checkpoints under both directories (of `steps`) hold the same weights to 1e-5 relative."""
        got, want = read_checkpoint(got_ckpt, steps), read_checkpoint(want_ckpt, steps)
        self.assertEqual(sorted(got), sorted(want))
        for k, ref in want.items():
            self.assertLessEqual(float(np.max(np.abs(got[k] - ref))), 1e-5 * max(1.0, float(np.max(np.abs(ref)))),
                                 f"final {k}")

    def test_diloco_resumes_exactly(self):
        # DiLoCo with two replicas of two stages, one replica per site, checkpointed after step 3: between outer
        # steps (inner_steps 2), so the groups' weights and moments differ, and after one outer step, so the outer
        # momentum is not zero. A second job resumed from that checkpoint must continue exactly as the first went on:
        # each group from its own weights and moments, the outer optimizer from its state, through the head's copy
        # (every worker fetches the files it reads).
        steps = 7
        parallel = ("{plan: manual, dp: 2, pp: 2, microbatches: 2, "
                    "placement: [{replica: 0, site: site-a}, {replica: 1, site: site-b}]}")
        diloco = "diloco: {inner_steps: 2, outer_lr: 0.7, outer_momentum: 0.9, codec: none}\n"
        first_ckpt = os.path.join(self.c.dir, "ckpt-diloco-first")
        text = spec_text("diloco-first", self.data, first_ckpt, steps, parallel) + diloco
        text = text.replace("every_steps: 0}", "every_steps: 3, keep: -1}")
        losses = self.submit_for_losses("diloco-first", text, range(1, steps + 1))

        step_dir = os.path.join(first_ckpt, "step_00000003")
        with open(os.path.join(step_dir, "manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest.get("diloco_groups"), 2, manifest)
        for name in ("model-s0", "model-s1", "model-g1-s0", "model-g1-s1", "optimizer-g1-s0", "optimizer-g1-s1",
                     "diloco-s0", "diloco-s1"):
            self.assertIn(f"{name}.safetensors", manifest["files"], sorted(manifest["files"]))
        # Group 1's weights are its own: one inner step apart from group 0's.
        g0 = read_safetensors(os.path.join(step_dir, "model-s1.safetensors"))
        g1 = read_safetensors(os.path.join(step_dir, "model-g1-s1.safetensors"))
        self.assertEqual(sorted(g0), sorted(g1))
        self.assertTrue(any(not np.array_equal(g0[k], g1[k]) for k in g0), "the groups' weights are equal at step 3")

        resumed_text = spec_text("diloco-resumed", self.data, os.path.join(self.c.dir, "ckpt-diloco-resumed"), steps,
                                 parallel) + diloco
        resumed_text = resumed_text.replace("every_steps: 0}", f"every_steps: 0, resume_from: '{step_dir}'}}")
        resumed = self.submit_for_losses("diloco-resumed", resumed_text, range(4, steps + 1))
        for step, loss in resumed.items():
            self.assertLessEqual(abs(loss - losses[step]), max(1e-5 * losses[step], 1.5e-6),
                                 f"step {step} after the resume: {loss} vs {losses[step]} uninterrupted")
        self.assert_same_final_weights(os.path.join(self.c.dir, "ckpt-diloco-resumed"), first_ckpt, steps)
        print(f"diloco resumed at step 3: steps 4-{steps} equal the uninterrupted job's "
              f"({', '.join(f'{resumed[s]:.6f}' for s in sorted(resumed))})")

    def test_diloco_warm_start_from_a_synchronous_checkpoint(self):
        # A warm start (docs/diloco.md): a DiLoCo job resumed from a synchronous job's checkpoint. Both sites start
        # from its weights, moments and data position (step 4's loss is the synchronous job's), the outer optimizer
        # from its weights; and the job goes on exactly as `train --local` resumed from the same checkpoint.
        steps = 6
        parallel = ("{plan: manual, dp: 2, microbatches: 2, "
                    "placement: [{replica: 0, site: site-a}, {replica: 1, site: site-b}]}")
        sync_ckpt = os.path.join(self.c.dir, "ckpt-warm-sync")
        text = spec_text("warm-sync", self.data, sync_ckpt, steps, parallel)
        sync = self.submit_for_losses("warm-sync", text.replace("every_steps: 0}", "every_steps: 3, keep: -1}"),
                                      range(1, steps + 1))
        step_dir = os.path.join(sync_ckpt, "step_00000003")
        diloco = "diloco: {inner_steps: 2, outer_lr: 0.7, outer_momentum: 0.9, codec: none}\n"
        warm_ckpt = os.path.join(self.c.dir, "ckpt-warm-diloco")
        warm_text = (spec_text("warm-diloco", self.data, warm_ckpt, steps, parallel)
                     .replace("every_steps: 0}", f"every_steps: 0, resume_from: '{step_dir}'}}") + diloco)
        warm = self.submit_for_losses("warm-diloco", warm_text, range(4, steps + 1))
        self.assertLessEqual(abs(warm[4] - sync[4]), max(1e-5 * sync[4], 1.5e-6), f"step 4: {warm[4]} vs {sync[4]}")
        self.assertNotEqual(warm[steps], sync[steps], "the sites never went apart")
        local_path = os.path.join(self.c.dir, "warm-local.yaml")
        with open(local_path, "w") as f:
            f.write(warm_text.replace("ckpt-warm-diloco", "ckpt-warm-local"))
        local = subprocess.run([GEOTRAIN, "train", "--local", local_path], capture_output=True, text=True, timeout=300)
        self.assertEqual(local.returncode, 0, local.stderr + local.stdout)
        self.assertIn("resumed from", local.stdout)
        ref = {s["step"]: s["loss"] for s in local_steps(local.stdout)}
        self.assertEqual(sorted(ref), list(range(4, steps + 1)), local.stdout)
        for step, loss in warm.items():
            # train --local prints 4 decimals: the bound is 1e-5 relative or that precision.
            self.assertLessEqual(abs(loss - ref[step]), max(1e-5 * ref[step], 5.1e-5), f"step {step}")
        self.assert_same_final_weights(warm_ckpt, os.path.join(self.c.dir, "ckpt-warm-local"), steps)
        print(f"diloco warm start at step 3: step 4 {warm[4]:.6f} = the synchronous job's {sync[4]:.6f}; "
              f"steps 4-{steps} and the final weights equal the simulation's")

    def test_lossy_wan_codecs(self):
        steps = 100
        results = {}
        for codec in ("none", "bf16", "int8"):
            losses, _, wan, _ = self.distributed_run(f"codec-{codec}", steps,
                                                     "{plan: manual, dp: 2, microbatches: 1, "
                                                     "placement: [{replica: 0, site: site-a}, {replica: 1, site: site-b}]}",
                                                     codec)
            results[codec] = (losses[-1], wan)
        base_loss, base_wan = results["none"]
        self.assertGreater(base_wan, 0)
        for codec, expected_ratio in (("bf16", 2.0), ("int8", 3.5)):
            loss, wan = results[codec]
            self.assertLessEqual(abs(loss - base_loss) / base_loss, 0.02, f"{codec}: {loss} vs {base_loss}")
            ratio = base_wan / wan
            print(f"{codec}: final loss {loss:.4f} vs {base_loss:.4f}; WAN bytes {wan} vs {base_wan} (x{ratio:.2f})")
            self.assertGreaterEqual(ratio, expected_ratio * 0.9, codec)


if __name__ == "__main__":
    unittest.main(verbosity=2)
