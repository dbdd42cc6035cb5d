"""Control plane with real processes on loopback: a head and three workers in two sites.

Checks: `status --json` shows them; kill -9 of a worker is detected within the default timeout;
kill -9 of the head and a restart on the same state dir brings the workers back and keeps the jobs;
a wrong token is refused; the metrics endpoint answers with the expected families.
Usage: control_plane_test.py PATH/TO/geotrain
"""
import os
import signal
import sys
import time
import unittest
import urllib.request

from geotrain_testing.clusters import LocalCluster, wait_for

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"


class ControlPlaneTest(unittest.TestCase):
    def setUp(self):
        self.c = LocalCluster(GEOTRAIN)
        self.c.start_head()
        self.c.start_worker("w-utah-1", "utah", ["RTX6000"])
        self.c.start_worker("w-utah-2", "utah", ["RTX6000"])
        self.c.start_worker("w-ams-1", "amsterdam", ["T4:65:16"])
        wait_for(lambda: len([s for s in self.c.worker_states().values() if s == "WORKER_ALIVE"]) == 3,
                 20, "three alive workers")

    def tearDown(self):
        if sys.exc_info()[0] is not None or hasattr(self, "_outcome") and not self._outcome.success:
            print(self.c.logs())
        self.c.close()

    def test_cluster_lifecycle(self):
        c = self.c
        status = c.status()
        sites = {s["name"]: s for s in status["sites"]}
        self.assertEqual(sites["utah"]["alive_workers"], 2)
        self.assertEqual(sites["amsterdam"]["alive_workers"], 1)
        ams = [w for w in status["workers"] if w["worker_id"] == "w-ams-1"][0]
        self.assertEqual(ams["devices"][0]["name"], "T4")
        self.assertAlmostEqual(ams["devices"][0]["tflops"], 65.0)
        table = c.cli(["status"]).stdout
        self.assertIn("amsterdam", table)
        self.assertIn("w-utah-2", table)

        spec = os.path.join(c.dir, "job.yaml")
        with open(spec, "w") as f:
            # Eight replicas need eight devices: with three workers the job waits, PENDING.
            f.write("name: kept-across-restart\ntrain: {steps: 10, global_batch: 8, seq_len: 16}\n"
                    "parallel: {plan: manual, dp: 8, microbatches: 1}\n")
        out = c.cli(["job", "submit", spec]).stdout
        self.assertIn("PENDING", out)
        job_id = out.split()[1]

        # A killed worker is marked dead within the default timeout (4 s, checked every second).
        os.killpg(c.workers["w-ams-1"].pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: c.worker_states().get("w-ams-1") == "WORKER_DEAD", 10, "w-ams-1 dead", 0.05)
        detected = time.monotonic() - killed
        print(f"worker death detected in {detected:.2f} s")
        self.assertLessEqual(detected, 5.5)

        # kill -9 the head; start it again on the same state dir: workers come back, the job is kept.
        os.killpg(c.head.pid, signal.SIGKILL)
        c.head.wait()
        c.start_head()
        # Back means registered again with the new head (a new incarnation), not only ALIVE: the new head restores
        # the workers' records from its state dir, and a loaded machine can show them ALIVE before they re-register.
        def back():
            workers = {w["worker_id"]: w for w in c.status()["workers"]}
            return all(workers.get(w, {}).get("state") == "WORKER_ALIVE" and int(workers[w].get("incarnation", 0)) >= 2
                       for w in ("w-utah-1", "w-utah-2"))

        wait_for(back, 15, "utah workers back")
        incarnations = {w["worker_id"]: int(w["incarnation"]) for w in c.status()["workers"]}
        self.assertGreaterEqual(incarnations["w-utah-1"], 2, "the worker registered again")
        listing = c.cli(["job", "list"]).stdout
        self.assertIn(job_id, listing)
        self.assertIn("kept-across-restart", listing)
        # The dead worker stays dead after the restart.
        self.assertEqual(c.worker_states().get("w-ams-1"), "WORKER_DEAD")

        # The job can still be cancelled, and its log shows both events.
        self.assertIn("CANCELLED", c.cli(["job", "cancel", job_id]).stdout)
        logs = c.cli(["job", "logs", job_id]).stdout
        self.assertIn("submitted kept-across-restart", logs)
        self.assertIn("CANCELLED", logs)

    def test_links_are_measured(self):
        def links():
            found = {(l["a"], l["b"]): l for l in self.c.status().get("site_links", [])}
            return found if ("amsterdam", "utah") in found and ("utah", "utah") in found else None
        found = wait_for(links, 20, "measured site links", 0.5)
        wan = found[("amsterdam", "utah")]
        self.assertGreater(wan["latency_ms"], 0)
        self.assertLess(wan["latency_ms"], 50, "loopback")
        self.assertGreater(wan["bandwidth_mbps"], 10)
        self.assertIn("LATENCY MS", self.c.cli(["status"]).stdout)

    def test_wrong_token_is_refused(self):
        r = self.c.cli(["status", "--token", "not-the-token"], check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("wrong cluster token", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, "one clear line")
        with open(os.path.join(self.c.dir, "head.log")) as f:
            self.assertIn("wrong cluster token", f.read())

    def test_unreachable_head_and_bad_spec_are_one_clear_line(self):
        r = self.c.cli(["status", "--head", "127.0.0.1:1"], check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("cannot reach the head at 127.0.0.1:1", r.stderr)
        bad = os.path.join(self.c.dir, "bad.yaml")
        with open(bad, "w") as f:
            f.write("train: {stepz: 3}\n")
        r = self.c.cli(["job", "submit", bad], check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("unknown key 'train.stepz'", r.stderr)
        self.assertIn(bad, r.stderr)
        # A port in use.
        r = self.c.cli(["head", "start", "--port", str(self.c.port), "--metrics-port", "-1",
                        "--state-dir", os.path.join(self.c.dir, "other")], check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--port", r.stderr)

    def test_metrics_endpoint(self):
        def scrape():
            return urllib.request.urlopen(f"http://127.0.0.1:{self.c.metrics_port}/metrics", timeout=10).read().decode()
        # Heartbeats arrive every second: wait for the first ones to be counted.
        body = wait_for(lambda: (lambda b: b if 'method="Heartbeat"' in b else None)(scrape()), 10, "heartbeats")
        for family in ("geotrain_workers", "geotrain_devices", "geotrain_jobs", "geotrain_actors",
                       "geotrain_rpc_duration_seconds", "geotrain_rpc_total", "process_cpu_seconds_total",
                       "process_resident_memory_bytes"):
            self.assertIn(f"# TYPE {family}", body, family)
        self.assertIn('geotrain_workers{site="utah",state="ALIVE"} 2', body)
        self.assertIn('geotrain_rpc_total{code="0",method="Heartbeat"}', body)


class TlsTest(unittest.TestCase):
    def test_tls_cluster(self):
        import subprocess
        c = LocalCluster(GEOTRAIN)
        try:
            certs = os.path.join(c.dir, "certs")
            subprocess.run(["bash", os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "make-certs.sh"),
                            certs], check=True, capture_output=True)
            # Every node serves and dials: certificate, key and CA (one configuration for every connection).
            ca = ["--tls-ca", os.path.join(certs, "ca.pem")]
            node_tls = ["--tls-cert", os.path.join(certs, "server.pem"),
                        "--tls-key", os.path.join(certs, "server.key")] + ca
            c.head = c._spawn(["head", "start", "--port", str(c.port), "--metrics-port", "-1",
                               "--state-dir", c.state_dir] + node_tls, "head.log")
            wait_for(lambda: c.cli(["status"] + ca, check=False).returncode == 0, 15, "the TLS head")
            # A plaintext client (no CA, none recorded on its machine) cannot talk to a TLS head, and is told why.
            token_file = os.path.join(c.state_dir, "token")
            plain = c.cli(["status", "--head", f"127.0.0.1:{c.port}", "--token-file", token_file], check=False,
                          env=dict(c.env, GEOTRAIN_HOME=os.path.join(c.dir, "elsewhere")))
            self.assertNotEqual(plain.returncode, 0)
            self.assertIn("TLS", plain.stderr)
            c.workers["w"] = c._spawn(["worker", "start", "--site", "s", "--worker-id", "w-tls",
                                       "--metrics-port", "-1", "--emulate-device", "T4"] + node_tls, "worker.log")
            wait_for(lambda: "w-tls" in c.cli(["status"] + ca, check=False).stdout, 15, "the TLS worker")
        except Exception:
            print(c.logs())
            raise
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
