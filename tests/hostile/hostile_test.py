"""Hostile clients against real processes on loopback (issue 15, point 6).

A head and two workers start; hostile_client then sends 10,000 malformed or random-byte requests to each of: the
head's gRPC port, a worker's port (its own service and its tensor streams) and the metrics ports (5,000 to the
head's, 5,000 to the worker's), from 8 threads each, each request bounded by a 5 s deadline. Afterwards:
every process is still running, the cluster status shows both workers alive, both metrics ports answer a scrape,
the requests were refused as such (no garbage call succeeded), and a job submitted afterwards (DP2 over both
workers, so the attacked worker's tensor streams carry its gradients) ends SUCCEEDED.

Usage: hostile_test.py PATH/TO/geotrain PATH/TO/hostile_client
"""
import collections
import os
import subprocess
import sys
import time
import unittest
import urllib.request

from geotrain_testing.clusters import LocalCluster, free_port, wait_for
from geotrain_testing.shards import write_token_shard

GEOTRAIN = sys.argv.pop(1)
HOSTILE = sys.argv.pop(1)
SEED = 15


def scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class HostileClientsTest(unittest.TestCase):
    def setUp(self):
        self.c = LocalCluster(GEOTRAIN)
        self.c.start_head()
        self.worker_port, self.worker_metrics = free_port(), free_port()
        self.c.workers["w0"] = self.c._spawn(
            ["worker", "start", "--site", "a", "--worker-id", "w0", "--port", str(self.worker_port), "--metrics-port",
             str(self.worker_metrics), "--emulate-device", "T4"], "worker-w0.log")
        self.c.start_worker("w1", "a", ["T4"])
        wait_for(lambda: list(self.c.worker_states().values()).count("WORKER_ALIVE") == 2, 30, "two workers")

    def tearDown(self):
        if hasattr(self, "_outcome") and not self._outcome.success:
            print(self.c.logs())
        self.c.close()

    def attack(self, kind, port, count, token=None):
        args = [HOSTILE, kind, f"127.0.0.1:{port}", str(count), str(SEED)] + ([token] if token else [])
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        outcomes = collections.Counter()
        elapsed = None
        for line in r.stdout.splitlines():
            name, value = line.rsplit(" ", 1)
            if name == "elapsed_s":
                elapsed = float(value)
            else:
                outcomes[name] = int(value)
        print(f"{kind} port {port}: {count} requests in {elapsed:.1f} s: {dict(sorted(outcomes.items()))}")
        self.assertEqual(sum(outcomes.values()), count)
        return outcomes

    def test_processes_serve_after_30000_hostile_requests(self):
        c = self.c
        token = c.token()
        pids = {"head": c.head.pid, "w0": c.workers["w0"].pid, "w1": c.workers["w1"].pid}
        rss_before = {name: rss_kib(pid) for name, pid in pids.items()}
        start = time.monotonic()
        head = self.attack("head", c.port, 10000, token)
        worker = self.attack("worker", self.worker_port, 10000, token)
        metrics = self.attack("metrics", c.metrics_port, 5000) + self.attack("metrics", self.worker_metrics, 5000)
        print(f"30000 hostile requests in {time.monotonic() - start:.1f} s; RSS KiB before "
              f"{rss_before}, after { {name: rss_kib(pid) for name, pid in pids.items()} }")

        # Every process is still there.
        for name, p in (("head", c.head), ("w0", c.workers["w0"]), ("w1", c.workers["w1"])):
            self.assertIsNone(p.poll(), f"{name} exited ({p.returncode})")
        # Nothing malformed was taken: garbage payloads never parse, tokenless calls are refused, unknown methods
        # are unimplemented; and the servers answered throughout (no call found the port closed).
        for outcomes in (head, worker):
            # UNIMPLEMENTED: a method a service declares for the head only (DataStaging's progress reports), which a
            # worker refuses before any token check; nothing is served.
            for name, n in outcomes.items():
                self.assertFalse(name.endswith(":OK"), f"a hostile request succeeded: {name} {n}")
                self.assertNotIn("refused", name)
            self.assertEqual(sum(n for name, n in outcomes.items() if name.startswith("notoken:")),
                             outcomes["notoken:UNAUTHENTICATED"] + outcomes["notoken:INVALID_ARGUMENT"] +
                             outcomes["notoken:INTERNAL"] + outcomes["notoken:UNIMPLEMENTED"])
        self.assertEqual(worker["unknown:UNIMPLEMENTED"], 2000)
        self.assertNotIn("http:refused", metrics)
        self.assertNotIn("http:get-failed", metrics)
        self.assertGreater(metrics["http:get-ok"], 0)

        # Every process still serves: status, scrapes, and a job across both workers.
        wait_for(lambda: list(c.worker_states().values()).count("WORKER_ALIVE") == 2, 30, "two workers alive")
        self.assertIn("process_open_fds", scrape(c.metrics_port))
        self.assertIn("process_open_fds", scrape(self.worker_metrics))
        data = os.path.join(c.dir, "train_000000.bin")
        write_token_shard(data, [(i * 7 + i // 97) % 512 for i in range(20000)])
        spec = os.path.join(c.dir, "after.yaml")
        with open(spec, "w") as f:
            f.write(f"name: after-hostile\nmodel: {{preset: gpt2-tiny-test}}\ndata: {{train: '{data}'}}\n"
                    "train: {global_batch: 4, seq_len: 16, steps: 3}\n"
                    "parallel: {plan: manual, dp: 2, microbatches: 1}\ncheckpoint: {every_steps: 0}\n")
        out = c.cli(["job", "submit", spec, "--follow"], check=False, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("SUCCEEDED", out.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
