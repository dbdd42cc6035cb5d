"""A real Prometheus server scrapes a real head: the head's families arrive with the right values.

Usage: prometheus_test.py PATH/TO/geotrain
"""
import json
import os
import shutil
import subprocess
import sys
import unittest
import urllib.parse
import urllib.request

from geotrain_testing.clusters import LocalCluster, free_port, wait_for

GEOTRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else "geotrain"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class PrometheusScrapeTest(unittest.TestCase):
    def test_prometheus_scrapes_head(self):
        if not os.path.exists(PROMETHEUS):
            self.fail("prometheus is not installed; run deploy/install-deps.sh")
        c = LocalCluster(GEOTRAIN)
        prom = None
        try:
            c.start_head()
            c.start_worker("w-a", "utah", ["A30"])
            c.start_worker("w-b", "utah", ["A30"])
            wait_for(lambda: list(c.worker_states().values()).count("WORKER_ALIVE") == 2, 20, "workers")
            port = free_port()
            config = os.path.join(c.dir, "prometheus.yml")
            with open(config, "w") as f:
                f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                        "scrape_configs:\n"
                        f"  - {{job_name: geotrain-head, static_configs: [{{targets: ['127.0.0.1:{c.metrics_port}']}}]}}\n")
            with open(os.path.join(c.dir, "prometheus.log"), "wb") as log:
                prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                                         f"--storage.tsdb.path={os.path.join(c.dir, 'tsdb')}",
                                         f"--web.listen-address=127.0.0.1:{port}"],
                                        stdout=log, stderr=subprocess.STDOUT)

            def query(expr):
                url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                try:
                    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
                except Exception:
                    return None
                result = body.get("data", {}).get("result", [])
                return result or None

            result = wait_for(lambda: query('geotrain_workers{site="utah",state="ALIVE"}'), 60,
                              "Prometheus to scrape geotrain_workers", 0.5)
            self.assertEqual(float(result[0]["value"][1]), 2.0)
            up = wait_for(lambda: query('up{job="geotrain-head"}'), 30, "up")
            self.assertEqual(float(up[0]["value"][1]), 1.0)
            self.assertIsNotNone(wait_for(lambda: query("geotrain_rpc_total"), 30, "rpc totals"))
        except Exception:
            print(c.logs())
            raise
        finally:
            if prom is not None:
                prom.kill()
                prom.wait()
            c.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
