"""The timed studies' harness (geotrain_testing.timed, tests/lib) against the real planner (`geotrain plan --predict`).

1. steady_steps: how many steps a plan runs and how many it skips, by its expected step.
2. refit_inside_site fits the bandwidths inside a site to the median of its profiling rounds: given rounds whose
   steps the planner itself predicted at known bandwidths, one fast and one slow around them, it finds those
   bandwidths again, where the fast round alone does not; and it records every round.
3. run_job on a real timed cluster: a job that outlasts its timeout raises, and is cancelled, so that it does not
   run on beside what a study measures next on the same cluster.
4. add_profiling_round on that cluster: a failed first round is raised (nothing to predict with); a failed later
   round is said and leaves the rounds before it.

Usage: study_harness_test.py PATH/TO/geotrain
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

from geotrain_testing import timed
from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"


class SteadyStepsTest(unittest.TestCase):
    def test_by_expected_step(self):
        self.assertEqual(timed.steady_steps(0), (12, 3))
        self.assertEqual(timed.steady_steps(0.7), (12, 3))
        self.assertEqual(timed.steady_steps(10), (3, 1))
        self.assertEqual(timed.steady_steps(19.9), (3, 1))
        self.assertEqual(timed.steady_steps(20), (2, 1))
        self.assertEqual(timed.steady_steps(82), (2, 1))


class RefitTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="geotrain_study_harness_")
        self.addCleanup(shutil.rmtree, self.work, ignore_errors=True)

    def test_median_of_rounds(self):
        data = write_tiny_corpus(os.path.join(self.work, "data"), vocab=50000, length=4096, repeats=2)
        topo = os.path.join(self.work, "t.yaml")
        timed.write_topology(topo, [("utah", [("RTX6000", 2), ("RTX6000", 2)])], [])
        specs = {}
        for name, parallel, _ in timed._inside_site_jobs("utah"):
            specs[name] = os.path.join(self.work, f"{name}.yaml")
            timed.write_job(specs[name], name, "gpt2-medium", data, parallel, 3, 16)
        base = {"efficiency": {"RTX6000": 0.43}, "intra_site_gbps": 100.0, "intra_site_activation_gbps": 0,
                "intra_site_latency_ms": 0.05, "wan_window_mb": 0}
        truth = dict(base, intra_site_gbps=6.0, intra_site_activation_gbps=7.0)
        steps = {name: timed.predict(GEOTRAIN, topo, spec, timed.planner_flags(truth))
                 for name, spec in specs.items()}

        def round_of(factor):
            return {name: (specs[name], steps[name] * factor) for name in specs}
        rounds = [round_of(1.3), round_of(0.8), round_of(1.0)]  # the median is the last, the mean none
        cal = timed.refit_inside_site(GEOTRAIN, topo, base, rounds)
        self.assertAlmostEqual(cal["intra_site_gbps"], 6.0, delta=0.06)
        self.assertAlmostEqual(cal["intra_site_activation_gbps"], 7.0, delta=0.07)
        self.assertEqual(cal["measured_rounds"]["dp2"], [steps["dp2"] * f for f in (1.3, 0.8, 1.0)])
        for name in specs:
            self.assertAlmostEqual(cal["predicted_after_fit"][name], steps[name], delta=0.01 * steps[name])
        self.assertEqual(base["intra_site_gbps"], 100.0)  # the base calibration is left as it was

        fast = timed.refit_inside_site(GEOTRAIN, topo, base, rounds[1:2])
        self.assertGreater(fast["intra_site_gbps"], 6.0 * 1.1)
        self.assertGreater(fast["intra_site_activation_gbps"], 7.0 * 1.1)


class TimedClusterTest(unittest.TestCase):
    """One timed cluster of two A30s in one site, for the harness's failure paths."""

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="geotrain_study_harness_")
        cls.data = write_tiny_corpus(os.path.join(cls.work, "data"), vocab=50000, length=4096, repeats=20)
        cls.topo = os.path.join(cls.work, "t.yaml")
        timed.write_topology(cls.topo, [("utah", [("A30", 2)])], [])
        try:
            cls.c = ClusterUp(GEOTRAIN, cls.topo, prefix="geotrain_study_harness_", up_args=["--timed-compute"])
        except BaseException:
            shutil.rmtree(cls.work, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        shutil.rmtree(cls.work, ignore_errors=True)

    def states(self):
        return [j["state"] for j in json.loads(self.c.cli(["job", "list", "--json"]).stdout)["jobs"]]

    def test_a_job_that_times_out_is_cancelled(self):
        before = len(self.states())
        spec = os.path.join(self.work, "long.yaml")  # GPT-2 medium DP2 on timed A30s: about 2 s a step, 1000 steps
        timed.write_job(spec, "long", "gpt2-medium", self.data, "{plan: manual, dp: 2, microbatches: 4}", 1000,
                        16)
        with self.assertRaises(AssertionError):
            timed.run_job(self.c, spec, timeout=3)
        self.assertEqual(self.states()[before:], ["JOB_CANCELLED"])

    def test_a_failed_later_profiling_round_is_said_and_left_out(self):
        missing = os.path.join(self.work, "missing_*.bin")  # every profiling job fails at set-up: no data
        said = []
        with self.assertRaises(RuntimeError):
            timed.add_profiling_round([], self.c, self.topo, "utah", self.work, missing, "gpt2-medium", 3, 120,
                                      said.append)
        earlier = [{"dp2": ("dp2.yaml", 2.0), "tp2": ("tp2.yaml", 9.0)}]
        rounds = list(earlier)
        timed.add_profiling_round(rounds, self.c, self.topo, "utah", self.work, missing, "gpt2-medium", 3, 120,
                                  said.append)
        self.assertEqual(rounds, earlier)
        self.assertEqual(len(said), 1)
        self.assertIn("a profiling round failed, left out", said[0])


if __name__ == "__main__":
    unittest.main()
