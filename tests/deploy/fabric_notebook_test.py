"""deploy/fabric/geotrain_study.ipynb, headless (nbclient and ipykernel from Debian), against a local
`geotrain cluster up` (tests/control/two-sites-5ms.yaml): every cell runs as a user would run it, with ON_FABRIC
False (the FABRIC cells do nothing) and the parameters cell's values overridden for a tiny model and a few steps,
as papermill would inject them. Checks the first job, followed in the background with a live plot (the cell that
starts it returns while the job runs; the plot drew every step), and what the study leaves: one run per ranked
plan, each SUCCEEDED with every step's loss and step time, the planner's ranks in order, and the plot.

Usage: fabric_notebook_test.py GEOTRAIN_BIN NOTEBOOK PYTHON_PACKAGE_DIR (ctest passes them; tests/deploy/), with
PYTHONPATH=tests/lib:PYTHON_PACKAGE_DIR (ctest sets it): this process imports geotrain from PYTHON_PACKAGE_DIR too.
"""
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import unittest

import geotrain
import nbclient
import nbformat

from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus

GEOTRAIN, NOTEBOOK, PACKAGE_DIR = (os.path.abspath(a) for a in sys.argv[1:4])  # the kernel runs elsewhere
del sys.argv[1:4]
SOURCE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

PLANS = 2
STEPS = 3
FIRST_JOB_STEPS = 40  # long enough that the cell starting the follower returns well before the end


class StudyNotebookTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.up = ClusterUp(GEOTRAIN, os.path.join(SOURCE_DIR, "tests", "control", "two-sites-5ms.yaml"))
        cls.work = tempfile.mkdtemp(prefix="geotrain_notebook_")

    @classmethod
    def tearDownClass(cls):
        cls.up.close()
        shutil.rmtree(cls.work, ignore_errors=True)

    def test_the_study_runs_headless(self):
        corpus = write_tiny_corpus(os.path.join(self.work, "data"))
        out_dir = os.path.join(self.work, "study")
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        parameters = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        self.assertEqual(len(parameters), 1, "the notebook has one cell tagged `parameters`")
        overrides = {"ON_FABRIC": False, "DATA": corpus, "MODEL": {"preset": "gpt2-tiny-test"}, "GLOBAL_BATCH": 8,
                     "SEQ_LEN": 16, "FIRST_JOB_STEPS": FIRST_JOB_STEPS, "STEPS": STEPS, "PLANS": PLANS,
                     "OUT_DIR": out_dir}
        for name in overrides:
            self.assertIn(f"\n{name} = ", "\n" + parameters[0].source, f"the parameters cell sets {name}")
        # Injected after the parameters cell, as papermill does, so the notebook's own values stay as they are.
        index = notebook.cells.index(parameters[0])
        notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
            "\n".join(f"{name} = {value!r}" for name, value in overrides.items())))

        # The client finds the head through the cluster record in GEOTRAIN_HOME, as on a user's machine.
        env = {"GEOTRAIN_HOME": self.up.home, "PYTHONPATH": PACKAGE_DIR, "MPLBACKEND": "Agg",
               "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
        saved = {name: os.environ.get(name) for name in list(env) + ["GEOTRAIN_HEAD", "GEOTRAIN_TOKEN",
                                                                     "GEOTRAIN_TOKEN_FILE"]}
        for name in ("GEOTRAIN_HEAD", "GEOTRAIN_TOKEN", "GEOTRAIN_TOKEN_FILE"):
            os.environ.pop(name, None)
        os.environ.update(env)  # the kernel inherits this process's environment
        try:
            client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                             resources={"metadata": {"path": self.work}})
            try:
                client.execute()
            except nbclient.exceptions.CellExecutionError as e:
                self.fail(f"a cell failed: {e}\n{self.up.process_logs()}")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

        printed = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                          for o in c.get("outputs", []))
        self.assertIn("site site-a: 2 alive workers", printed)
        self.assertIn("SUCCEEDED - plan:", printed)
        first = re.search(r"following (job-\d+) in the background", printed)
        self.assertIsNotNone(first, printed)
        # The cell that starts following returned while the job ran: its reply came before the job's end.
        follow_cell = [c for c in notebook.cells if "client.follow(first, on_event=" in c.source]
        self.assertEqual(len(follow_cell), 1)
        returned = datetime.datetime.fromisoformat(
            follow_cell[0].metadata.execution["shell.execute_reply"].replace("Z", "+00:00")).timestamp()
        with open(os.path.join(self.up.home, "current_cluster.json")) as f:
            record = json.load(f)
        with geotrain.Client(head=record["address"], token_file=record["token_file"]) as client:
            events = list(client.follow(first.group(1)))
        ended = [e for e in events if e.state == "SUCCEEDED"][0].proto.unix_ms / 1000
        self.assertLess(returned, ended, "the cell following the job returned only after the job had ended")
        self.assertRegex(printed, rf"{FIRST_JOB_STEPS} steps: loss \d+\.\d+ -> \d+\.\d+")
        # The first job's live plot, as its figure stood once the job had ended.
        with open(os.path.join(out_dir, "first-job.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        with open(os.path.join(out_dir, "study.json")) as f:
            runs = json.load(f)
        self.assertEqual([r["rank"] for r in runs], list(range(1, len(runs) + 1)))
        self.assertTrue(1 <= len(runs) <= PLANS, runs)
        for run in runs:
            self.assertEqual(run["state"], "SUCCEEDED", run)
            self.assertEqual(run["steps"], list(range(1, STEPS + 1)), run)
            self.assertTrue(all(loss > 0 for loss in run["loss"]), run)
            self.assertTrue(all(seconds > 0 for seconds in run["step_seconds"]), run)
            self.assertGreater(run["predicted_step_seconds"], 0, run)
        with open(os.path.join(out_dir, "study.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        # Each study run is a job of its own on the head, with the plan it was given.
        jobs = {j["job_id"]: j for j in json.loads(self.up.cli(["job", "list", "--json"]).stdout).get("jobs", [])}
        for run in runs:
            self.assertEqual(jobs[run["job_id"]]["name"], f"study-plan-{run['rank']}")


if __name__ == "__main__":
    unittest.main()
