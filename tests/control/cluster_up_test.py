"""`geotrain cluster up/status/down` on a shipped topology: a head, the WAN emulator and four workers
come up; cross-site paths measured by the workers show the configured one-way latency; `status` needs
no flags; `down` leaves none of the started processes running. A one-site topology (no links) comes up without
the emulator, says so, and its workers join. A worker that exits before it joins fails `cluster up` at once, with
the worker's last log line. `--slowdown` starts the workers it names slowed, and bad entries are refused.

Usage: cluster_up_test.py PATH/TO/geotrain REPO_ROOT
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from geotrain_testing.clusters import wait_for

GEOTRAIN = sys.argv.pop(1)
ROOT = sys.argv.pop(1)


def cli_in(home):
    """A function that runs geotrain with GEOTRAIN_HOME=home (and no head or token from this environment)."""
    env = dict(os.environ, GEOTRAIN_HOME=home)
    # OMP_WAIT_POLICY too (`make test` sets it): cluster up chooses the cluster's own.
    for k in ("GEOTRAIN_HEAD", "GEOTRAIN_TOKEN", "GEOTRAIN_TOKEN_FILE", "OMP_WAIT_POLICY"):
        env.pop(k, None)

    def run(*args, check=True):
        r = subprocess.run([GEOTRAIN] + list(args), capture_output=True, text=True, env=env, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"{args} failed: {r.stdout}\n{r.stderr}")
        return r
    return run


class ClusterUpTest(unittest.TestCase):
    def test_up_status_down(self):
        home = tempfile.mkdtemp(prefix="geotrain_cluster_")
        state = os.path.join(home, "cluster")
        run = cli_in(home)

        try:
            topo = os.path.join(ROOT, "deploy", "topologies", "two-sites-30ms.yaml")
            out = run("cluster", "up", topo).stdout
            self.assertIn("4 workers in 2 sites", out)
            again = run("cluster", "up", topo, check=False)
            self.assertNotEqual(again.returncode, 0)
            self.assertIn("already up", again.stderr)

            def wan_link():
                status = json.loads(run("status", "--json").stdout)
                for link in status.get("site_links", []):
                    if {link["a"], link["b"]} == {"site-a", "site-b"}:
                        return link
                return None
            link = wait_for(wan_link, 30, "a measured site-a/site-b link", 0.5)
            print(f"measured one-way latency {link['latency_ms']:.2f} ms (configured 30)")
            # The probe's best round trip over the emulated path: 2 x 30 ms plus loopback and gRPC costs.
            # Those costs reach a few ms under ASan on a loaded 2-core host (CI measured 32.17 ms), so the
            # upper bound only rules out a delay applied twice or not at all, never the probe's overhead.
            self.assertGreaterEqual(link["latency_ms"], 29.0)
            self.assertLessEqual(link["latency_ms"], 38.0)
            shown = run("cluster", "status").stdout
            self.assertIn("site-a > site-b", shown)
            self.assertIn("4 of 4 workers alive", shown)

            with open(os.path.join(state, "cluster.json")) as f:
                record = f.read()
            pids = [int(p) for p in __import__("re").findall(r'"pid": "(\d+)"', record)]
            self.assertEqual(len(pids), 6)  # emulator, head, four workers
            # The cluster's processes share the machine: their OpenMP threads sleep at barriers, not spin.
            for pid in pids:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    self.assertIn(b"OMP_WAIT_POLICY=PASSIVE", f.read().split(b"\0"), f"process {pid}")
            self.assertIn("stopped 6 process(es)", run("cluster", "down").stdout)
            for pid in pids:
                alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/cmdline").read() != ""
                self.assertFalse(alive, f"process {pid} still runs after cluster down")
            self.assertNotEqual(run("cluster", "status", check=False).returncode, 0)
        except Exception:
            for name in sorted(os.listdir(os.path.join(state, "logs"))) if os.path.isdir(os.path.join(state, "logs")) else []:
                with open(os.path.join(state, "logs", name), errors="replace") as f:
                    print(f"==== {name}\n{f.read()[-3000:]}")
            run("cluster", "down", check=False)
            raise
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def test_one_site_needs_no_emulator(self):
        home = tempfile.mkdtemp(prefix="geotrain_cluster_")
        run = cli_in(home)
        try:
            topo = os.path.join(home, "one-site.yaml")
            with open(topo, "w") as f:
                f.write("sites:\n  - {name: lab, workers: [{device: T4, count: 1}, {device: T4, count: 1}]}\n")
            out = run("cluster", "up", topo).stdout
            self.assertIn("2 workers in 1 sites, no WAN emulator (no links between sites)", out)
            shown = run("cluster", "status").stdout
            self.assertIn("no WAN emulator", shown)
            self.assertIn("2 of 2 workers alive", shown)
            self.assertIn("stopped 3 process(es)", run("cluster", "down").stdout)  # head, two workers
        except Exception:
            run("cluster", "down", check=False)
            raise
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def test_slowed_workers(self):
        # `cluster up --slowdown NAME=F` by site and by worker id: those workers start with `worker start --slowdown`,
        # so their devices report the factor and their TFLOP/s divided by it. Bad entries are refused before anything
        # runs, and so are `worker start`'s bad factors and --slowdown with --timed-compute.
        home = tempfile.mkdtemp(prefix="geotrain_cluster_")
        run = cli_in(home)
        try:
            topo = os.path.join(home, "two-sites.yaml")
            with open(topo, "w") as f:
                f.write("sites:\n  - {name: fast, workers: [{device: T4}]}\n"
                        "  - {name: slow, workers: [{device: T4}, {device: T4}]}\n")
            for args, why in [(["--slowdown", "nowhere=2"], "no site or worker nowhere"),
                              (["--slowdown", "slow=0.5"], "--slowdown 0.5: the factor must be a finite number >= 1"),
                              (["--slowdown", "slow"], "expected SITE=FACTOR"),
                              (["--slowdown", "slow=2", "--timed-compute"], "use one or the other")]:
                r = run("cluster", "up", topo, *args, check=False)
                self.assertNotEqual(r.returncode, 0, args)
                self.assertIn(why, r.stderr, args)
                self.assertFalse(os.path.exists(os.path.join(home, "cluster", "cluster.json")), args)
            for args, why in [(["--slowdown", "0.5"], "--slowdown 0.5: the factor must be a finite number >= 1"),
                              (["--slowdown", "2", "--emulate-device", "H100", "--timed-compute"],
                               "use one or the other")]:
                r = run("worker", "start", "--site", "x", "--head", "127.0.0.1:1", "--token", "t", *args, check=False)
                self.assertNotEqual(r.returncode, 0, args)
                self.assertIn(why, r.stderr, args)

            out = run("cluster", "up", topo, "--slowdown", "slow=2", "--slowdown", "slow-1=4").stdout
            self.assertIn("slowed CPUs (--slowdown): slow-0 2x, slow-1 4x", out)
            devices = {w["worker_id"]: w["devices"][0] for w in json.loads(run("status", "--json").stdout)["workers"]}
            self.assertEqual(devices["fast-0"]["slowdown"], 0)
            self.assertAlmostEqual(devices["fast-0"]["tflops"], 65)
            for worker, factor in [("slow-0", 2), ("slow-1", 4)]:
                self.assertEqual(devices[worker]["slowdown"], factor)
                self.assertAlmostEqual(devices[worker]["tflops"], 65 / factor)
                self.assertEqual(devices[worker]["name"], f"T4 (EMULATED: slowed {factor}x)")
            self.assertIn("T4 (EMULATED: slowed 4x)", run("status").stdout)
            self.assertIn("stopped 4 process(es)", run("cluster", "down").stdout)  # head, three workers
        except Exception:
            run("cluster", "down", check=False)
            raise
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def test_a_worker_that_exits_fails_up_at_once(self):
        # `cluster up` starts its processes from its own directory: a copy of geotrain next to a script named
        # geotrain that makes worker lab-1 exit as a worker that cannot listen does, and runs the real binary
        # for everything else.
        home = tempfile.mkdtemp(prefix="geotrain_cluster_")
        run = cli_in(home)
        try:
            bin_dir = os.path.join(home, "bin")
            os.makedirs(bin_dir)
            real = os.path.join(bin_dir, "geotrain-real")
            shutil.copy(GEOTRAIN, real)
            wrapper = os.path.join(bin_dir, "geotrain")
            with open(wrapper, "w") as f:
                f.write('#!/bin/sh\n'
                        'case " $* " in *" --worker-id lab-1 "*)\n'
                        '  echo "geotrain: worker: cannot listen on 127.0.0.1:1 (port in use?); choose another with '
                        '--port" >&2; exit 1;;\n'
                        'esac\n'
                        f'exec "{real}" "$@"\n')
            os.chmod(wrapper, 0o755)
            topo = os.path.join(home, "one-site.yaml")
            with open(topo, "w") as f:
                f.write("sites:\n  - {name: lab, workers: [{device: T4, count: 1}, {device: T4, count: 1}]}\n")
            started = time.monotonic()
            r = subprocess.run([real, "cluster", "up", topo], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, GEOTRAIN_HOME=home))
            self.assertNotEqual(r.returncode, 0, r.stdout)
            self.assertLess(time.monotonic() - started, 30, "cluster up waited for a worker that had exited")
            self.assertIn("worker lab-1 exited before it joined", r.stderr)
            self.assertIn("cannot listen on 127.0.0.1:1 (port in use?)", r.stderr)
            self.assertIn("worker-lab-1.log", r.stderr)
            # No cluster is recorded. (The head it started runs geotrain-real, which `cluster up` does not stop: it
            # stops only processes whose binary is named geotrain, in case a pid was reused. The finally does.)
            self.assertNotEqual(run("cluster", "status", check=False).returncode, 0)
        finally:
            subprocess.run(["pkill", "-9", "-f", os.path.join(home, "bin")], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
