"""`geotrain plan` answers what the head runs for `plan: auto`, however the job is described.

- Five topologies (three mixed-GPU sites about 50 ms apart, the demo's two sites, one site of A100s, Utah and
  Amsterdam 103 ms apart, three sites behind a slow link): `plan --model ... --global-batch ... --seq-len ...` and
  `plan --job SPEC` give the same plan (dp, pp, tp, microbatches, schedule, the placement's sites) and the same
  predicted step; `--allow-diloco` and the spec's `allow_diloco: true` agree too.
- The devices column never contradicts the explanation: a plan that leaves devices out says so in both.
- `--sites all` (and `parallel: {sites: all}`) gives a plan with a device in every site and an explanation of what
  the requirement costs; a site with no free device is named (a submitted job waits for one).
- On a `cluster up` of two of the topologies the head's own planner (`job plan SPEC`, the PlanJob RPC that
  `plan: auto` uses, on the links the head measured) picks the plan the offline command picks for that cluster
  and those links (`--emulated`: CPU workers standing in for the GPUs).
Usage: plan_agreement_test.py PATH/TO/geotrain
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

from geotrain_testing.clusters import ClusterUp, wait_for

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"

TOPOLOGIES = {
    "mixed": """sites:
  - {name: utah, workers: [{device: RTX6000, count: 3}]}
  - {name: tacc, workers: [{device: A30, count: 2}]}
  - {name: star, workers: [{device: T4, count: 2}, {device: A40}]}
links:
  - {a: utah, b: tacc, latency_ms: 50, bandwidth_mbps: 1000}
  - {a: utah, b: star, latency_ms: 50, bandwidth_mbps: 1000}
  - {a: tacc, b: star, latency_ms: 50, bandwidth_mbps: 1000}
""",
    "two-sites": """sites:
  - {name: site-a, workers: [{device: RTX6000}, {device: RTX6000}]}
  - {name: site-b, workers: [{device: RTX6000}, {device: RTX6000}]}
links:
  - {a: site-a, b: site-b, latency_ms: 30, bandwidth_mbps: 1000}
""",
    "one-site": """sites:
  - {name: lab, workers: [{device: A100, count: 4}]}
""",
    "utah-amsterdam": """sites:
  - {name: utah, workers: [{device: RTX6000, count: 3}]}
  - {name: amsterdam, workers: [{device: RTX6000, count: 3}]}
links:
  - {a: utah, b: amsterdam, latency_ms: 103, bandwidth_mbps: 1000}
""",
    "slow-link": """sites:
  - {name: a, workers: [{device: A30}, {device: A30}]}
  - {name: b, workers: [{device: A30}, {device: A30}]}
  - {name: c, workers: [{device: T4}, {device: T4}]}
links:
  - {a: a, b: b, latency_ms: 10, bandwidth_mbps: 10000}
  - {a: a, b: c, latency_ms: 40, bandwidth_mbps: 100}
  - {a: b, b: c, latency_ms: 40, bandwidth_mbps: 100}
""",
}


def chosen(out):
    """The plan the head runs, from `plan --json`: what must agree."""
    d = json.loads(out)
    p = d["head_runs"]
    sites = sorted({pin.get("site", "") for pin in p.get("placement", [])})
    return ({k: p.get(k) for k in ("dp", "pp", "tp", "microbatches", "schedule", "sync")} | {"sites": sites},
            round(d["predicted_step_seconds"], 9), d)


class PlanAgreementTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="geotrain_plan_agree_")
        cls.topologies = {}
        for name, text in TOPOLOGIES.items():
            path = os.path.join(cls.dir, f"{name}.yaml")
            with open(path, "w") as f:
                f.write(text)
            cls.topologies[name] = path

    def plan(self, *args, check=True):
        r = subprocess.run([GEOTRAIN, "plan"] + list(args), capture_output=True, text=True, timeout=120)
        if check:
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    def spec(self, name, model, batch, seq, parallel="{plan: auto}"):
        path = os.path.join(self.dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"name: {name}\nmodel: {{preset: {model}}}\ndata: {{train: '/nonexistent/train_*.bin'}}\n"
                    f"train: {{global_batch: {batch}, seq_len: {seq}}}\nparallel: {parallel}\n")
        return path

    def test_both_ways_agree_on_five_topologies(self):
        for name, topology in self.topologies.items():
            with self.subTest(topology=name):
                by_model = chosen(self.plan("--topology", topology, "--model", "gpt2-medium", "--global-batch", "64",
                                            "--seq-len", "1024", "--json").stdout)
                spec = self.spec(f"medium-{name}", "gpt2-medium", 64, 1024)
                by_job = chosen(self.plan("--topology", topology, "--job", spec, "--json").stdout)
                self.assertEqual(by_model[0], by_job[0])
                self.assertEqual(by_model[1], by_job[1])
                print(f"{name}: {by_job[0]} at {by_job[1]:.3f} s")

    def test_allow_diloco_agrees_both_ways(self):
        topology = self.topologies["utah-amsterdam"]
        by_flag = chosen(self.plan("--topology", topology, "--model", "gpt2", "--global-batch", "32", "--seq-len",
                                   "512", "--allow-diloco", "--json").stdout)
        spec = self.spec("diloco", "gpt2", 32, 512, "{plan: auto, allow_diloco: true}")
        by_spec = chosen(self.plan("--topology", topology, "--job", spec, "--json").stdout)
        self.assertEqual(by_flag[0], by_spec[0])
        self.assertTrue(any("DiLoCo" in line for line in by_spec[2]["explanation"]), by_spec[2]["explanation"])

    def test_the_devices_column_agrees_with_the_explanation(self):
        for name, topology in self.topologies.items():
            with self.subTest(topology=name):
                d = json.loads(self.plan("--topology", topology, "--model", "gpt2-medium", "--global-batch", "64",
                                         "--seq-len", "1024", "--json").stdout)
                top = d["ranked"][0]
                left_out = [line for line in d["explanation"] if line.startswith("left out: ")]
                self.assertEqual(len(left_out), 1, d["explanation"])
                if top["left_out_devices"]:
                    self.assertTrue(top["devices_used"].startswith("without "), top["devices_used"])
                    self.assertIn(top["devices_used"][len("without "):], left_out[0])
                else:
                    self.assertEqual(top["devices_used"], "all devices")
                    self.assertTrue(left_out[0].startswith("left out: none"), left_out[0])
        # --no-subsets is a what-if on the planner alone, and its table's devices column says what the plan uses.
        text = self.plan("--topology", self.topologies["mixed"], "--model", "gpt2-medium", "--global-batch", "64",
                         "--seq-len", "1024", "--no-subsets").stdout
        self.assertIn("what-if", text)
        first_row = next(line for line in text.splitlines() if line.startswith("1 "))
        if "left out: none" not in text:
            self.assertIn("without", first_row)

    def test_required_sites(self):
        topology = self.topologies["mixed"]
        d = json.loads(self.plan("--topology", topology, "--model", "gpt2-medium", "--global-batch", "64",
                                 "--seq-len", "1024", "--sites", "all", "--json").stdout)
        sites = {pin["site"] for pin in d["head_runs"]["placement"]}
        self.assertEqual(sites, {"utah", "tacc", "star"})
        self.assertTrue(d["explanation"][0].startswith("sites required (all): the best plan on them takes"),
                        d["explanation"][0])
        spec = self.spec("sites", "gpt2-medium", 64, 1024, "{plan: auto, sites: all}")
        self.assertEqual(chosen(json.dumps(d))[0],
                         chosen(self.plan("--topology", topology, "--job", spec, "--json").stdout)[0])
        bad = self.plan("--topology", topology, "--model", "gpt2-medium", "--global-batch", "64", "--seq-len",
                        "1024", "--sites", "utah,mars", check=False)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("parallel.sites needs site 'mars', which has no free device on an alive worker now (sites with "
                      "free devices: star, tacc, utah)", bad.stderr)

    def test_the_head_picks_the_offline_plan_on_cluster_up(self):
        # A small model, so that the plan is about these devices and links, not memory. The head plans with the links
        # it measured (on a loaded machine a little slower than configured): the offline plan is made from the same
        # figures, as `cluster up` runs the topology (--emulated: CPU workers standing in for the GPUs).
        for name in ("two-sites", "slow-link"):
            with self.subTest(topology=name):
                spec = self.spec(f"small-{name}", "gpt2-tiny-test", 16, 64)
                cluster = ClusterUp(GEOTRAIN, self.topologies[name])
                try:
                    pairs = len(TOPOLOGIES[name].split("links:")[1].strip().splitlines())

                    def measured():
                        links = json.loads(cluster.cli(["status", "--json"]).stdout).get("site_links", [])
                        links = [link for link in links if int(link.get("samples", 0)) > 0 and link["a"] != link["b"]]
                        return links if len(links) >= pairs else None

                    links = wait_for(measured, 60, "the head's link measurements")
                    reply = json.loads(cluster.cli(["job", "plan", spec, "--json"]).stdout)
                    links = measured()  # the figures as they were when the head planned
                finally:
                    cluster.close()
                topology = os.path.join(self.dir, f"{name}-measured.yaml")
                with open(topology, "w") as f:
                    f.write(TOPOLOGIES[name].split("links:")[0] + "links:\n")
                    for link in links:
                        f.write(f"  - {{a: {link['a']}, b: {link['b']}, latency_ms: {link['latency_ms']}, "
                                f"bandwidth_mbps: {link['bandwidth_mbps']}}}\n")
                offline = chosen(self.plan("--topology", topology, "--job", spec, "--emulated", "--json").stdout)
                head = reply["plans"][0]["parallel"]
                head_sites = sorted({pin.get("site", "") for pin in head.get("placement", [])})
                got = {k: head.get(k) for k in ("dp", "pp", "tp", "microbatches", "schedule", "sync")}
                got["sites"] = head_sites
                self.assertEqual(got, offline[0], f"head {reply['plans'][0]['summary']}; links {links}")


if __name__ == "__main__":
    unittest.main()
