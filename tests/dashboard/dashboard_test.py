"""The head's web dashboard in a real browser (Debian's headless Chromium) against a real cluster.

`geotrain cluster up` brings up two sites 5 ms apart and prints a dashboard link that logs in at once; a two-stage
pipeline job spanning both sites runs. While it runs and after it ended, Chromium loads each page through that link
and the test reads the rendered DOM: the cluster page shows both sites, their link (configured and measured) and
the workers; the jobs page the job; the job page its id, a loss chart with one point per reported step, its plan
and the WAN bytes of its link; the plan page ranked plans with the planner's explanation. A wrong or missing token
sees only the login page. Plain HTTP checks the rest: the JSON is 401 without the token and answers a bearer token,
the link sets an HttpOnly SameSite=Strict cookie, a cross-site POST is refused, /metrics is unchanged. A head with TLS
serves the dashboard over HTTPS only: a plaintext client gets nothing. Screenshots of each page are written to
SCREENSHOT_DIR (docs/images/dashboard/ holds copies).

Usage: dashboard_test.py PATH/TO/geotrain SCREENSHOT_DIR REPO_ROOT
Skips (exit 77) only when Chromium is not installed (deploy/install-deps.sh installs it).
"""
import http.client
import json
import os
import random
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

from geotrain_testing.clusters import free_port, private_env
from geotrain_testing.shards import write_token_shard

GEOTRAIN = os.path.abspath(sys.argv.pop(1))
SCREENSHOTS = os.path.abspath(sys.argv.pop(1))
ROOT = os.path.abspath(sys.argv.pop(1))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 60

TOPOLOGY = """# Two sites 5 ms apart, one emulated T4 worker each.
sites:
  - {name: site-a, workers: [{device: T4}]}
  - {name: site-b, workers: [{device: T4}]}
links:
  - {a: site-a, b: site-b, latency_ms: 5, bandwidth_mbps: 1000, jitter_ms: 0}
"""


def write_corpus(directory):
    """A small learnable token shard (llm.c's .bin layout: a 256 int32 header, then uint16 tokens); its path."""
    rng = random.Random(7)
    base = [rng.randrange(512) for _ in range(97)]
    tokens = [rng.randrange(512) if rng.random() < 0.1 else t for _ in range(200) for t in base]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "train_000000.bin")
    write_token_shard(path, tokens)
    return path


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def http(url, headers=None, data=None, context=None):
    """(status, headers, body) of one request, redirects not followed."""
    opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=context))
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data is not None else "GET")
    try:
        with opener.open(request, timeout=20) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


class Cluster:
    """A `geotrain cluster up` cluster in its own GEOTRAIN_HOME; close() brings it down and removes it."""

    def __init__(self):
        self.home = tempfile.mkdtemp(prefix="geotrain_dashboard_")
        self.env = private_env(self.home)
        self.topology = os.path.join(self.home, "two-sites.yaml")
        with open(self.topology, "w") as f:
            f.write(TOPOLOGY)

    def cli(self, *args, check=True, timeout=120):
        r = subprocess.run([GEOTRAIN, *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"geotrain {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def logs(self):
        out = []
        logs = os.path.join(self.home, "cluster", "logs")
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            with open(os.path.join(logs, name), errors="replace") as f:
                out.append(f"==== {name}\n" + "".join(f.readlines()[-40:]))
        return "\n".join(out)

    def close(self):
        self.cli("cluster", "down", check=False)
        shutil.rmtree(self.home, ignore_errors=True)


class Browser:
    """Headless Chromium, one fresh profile per page load (so only the link in the address can log it in)."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.loads = 0

    def run(self, url, *extra):
        self.loads += 1
        profile = os.path.join(self.workdir, f"profile-{self.loads}")
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
                f"--user-data-dir={profile}", "--virtual-time-budget=6000", *extra, url]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        shutil.rmtree(profile, ignore_errors=True)
        return r

    def dom(self, url):
        r = self.run(url, "--dump-dom")
        if r.returncode != 0 or "<html" not in r.stdout:
            raise AssertionError(f"chromium --dump-dom {url} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r.stdout

    def screenshot(self, url, name, height=1800):
        os.makedirs(SCREENSHOTS, exist_ok=True)
        path = os.path.join(SCREENSHOTS, name)
        if os.path.exists(path):
            os.remove(path)
        r = self.run(url, f"--screenshot={path}", f"--window-size=1400,{height}")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            raise AssertionError(f"no screenshot {path} from chromium: {r.stderr[-2000:]}")
        return path


def with_token(url, path, token):
    """The dashboard page `path` (with its query) as a link that logs in."""
    parsed = urllib.parse.urlsplit(url)
    page = urllib.parse.urlsplit(path)
    query = "&".join(q for q in (page.query, "token=" + urllib.parse.quote(token)) if q)
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, page.path, query, ""))


@unittest.skipIf(CHROMIUM is None, "")
class DashboardTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster()
        cls.browser = Browser(cls.cluster.home)
        try:
            out = cls.cluster.cli("cluster", "up", cls.cluster.topology).stdout
            m = re.search(r"^dashboard \(logs in with the cluster token\): (\S+)\?token=(\S+)$", out, re.M)
            if not m:
                raise AssertionError("cluster up printed no dashboard link:\n" + out)
            cls.url, cls.token = m.group(1), m.group(2)
            data = write_corpus(os.path.join(cls.cluster.home, "data"))
            cls.checkpoints = os.path.join(cls.cluster.home, "ckpt")
            spec = os.path.join(cls.cluster.home, "web.yaml")
            with open(spec, "w") as f:
                f.write(f"name: dashboard-demo\nmodel: {{preset: gpt2-tiny-test}}\n"
                        f"data: {{train: '{data}', val: '{data}'}}\n"
                        f"train: {{steps: {STEPS}, global_batch: 4, seq_len: 16, eval_every: 10}}\n"
                        "parallel:\n  plan: manual\n  pp: 2\n  microbatches: 2\n  placement:\n"
                        "    - {replica: 0, stage: 0, site: site-a}\n    - {replica: 0, stage: 1, site: site-b}\n"
                        f"checkpoint: {{dir: '{cls.checkpoints}', every_steps: 20}}\n")
            cls.job_id = cls.cluster.cli("job", "submit", spec).stdout.split()[1]
        except BaseException:
            print(cls.cluster.logs())
            cls.cluster.close()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def job(self):
        return json.loads(self.cluster.cli("job", "status", self.job_id, "--json").stdout)

    def wait_for(self, what, predicate, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.3)
        print(self.cluster.logs())
        self.fail(f"timed out waiting for {what}")

    def loss_points(self, dom):
        chart = dom[dom.index('id="loss-chart"'):]
        chart = chart[:chart.index("</svg>")]
        training = chart[chart.index('data-series="training"'):]
        training = training[:training.index("</g>")]
        return len(re.findall(r'<circle class="point"', training))

    def test_1_status_gives_the_dashboard_url(self):
        status = json.loads(self.cluster.cli("status", "--json").stdout)
        self.assertEqual(status["dashboard_url"], self.url)
        self.assertIn(f"dashboard: {self.url}", self.cluster.cli("status").stdout)

    def test_2_pages_render_the_job_live_and_after_it_ended(self):
        # While it runs: the job page already draws the steps reported so far.
        self.wait_for("a few steps", lambda: int(self.job().get("step", 0)) >= 3, 120)
        live = self.browser.dom(with_token(self.url, f"/job?id={self.job_id}", self.token))
        self.assertIn(self.job_id, live)
        self.assertGreaterEqual(self.loss_points(live), 3)
        cluster = self.browser.dom(with_token(self.url, "/", self.token))
        if self.job()["state"] == "JOB_RUNNING":  # still running after the page was drawn: it drew the job's actors
            self.assertIn(f"{self.job_id}-r0s0t0", cluster)
            self.assertIn(f"{self.job_id}-r0s1t0", cluster)
            self.assertRegex(cluster, r"site-a&gt;site-b: [0-9.]+ Mbit/s")
        self.browser.screenshot(with_token(self.url, f"/job?id={self.job_id}", self.token), "job-running.png", 2600)
        self.browser.screenshot(with_token(self.url, "/", self.token), "cluster-running.png", 1500)

        self.wait_for("the job's end", lambda: self.job()["state"] in ("JOB_SUCCEEDED", "JOB_FAILED"), 240)
        job = self.job()
        self.assertEqual(job["state"], "JOB_SUCCEEDED", job)

        cluster = self.browser.dom(with_token(self.url, "/", self.token))
        self.assertIn('data-sites="2"', cluster)
        self.assertIn('data-links="1"', cluster)
        self.assertIn('data-link="site-a|site-b"', cluster)
        self.assertIn("conf 5.0 ms, 1,000 Mbit/s", cluster)
        self.assertRegex(cluster, r"meas [0-9.]+ ms")
        self.assertIn("site-a-0", cluster)
        self.assertIn("site-b-0", cluster)
        self.assertIn("T4", cluster)

        jobs = self.browser.dom(with_token(self.url, "/jobs", self.token))
        self.assertIn(self.job_id, jobs)
        self.assertIn("dashboard-demo", jobs)
        self.assertIn("SUCCEEDED", jobs)

        page = self.browser.dom(with_token(self.url, f"/job?id={self.job_id}", self.token))
        self.assertIn(self.job_id, page)
        self.assertEqual(self.loss_points(page), STEPS, "one loss point per reported step")
        self.assertIn(f'data-points="{STEPS}"', page)
        self.assertIn("1 x 2 x 1", page)              # the plan: dp x pp x tp
        self.assertIn("r0s0@site-a, r0s1@site-b", page)  # its placement
        self.assertIn("site-a&gt;site-b", page)        # WAN bytes by link
        self.assertIn(f"checkpoint of step {STEPS} complete", page)
        self.assertIn("MFU", page)

        plan = self.browser.dom(with_token(
            self.url, "/plan?plan=1&spec=" + urllib.parse.quote(
                "model: {preset: gpt2-tiny-test}\ntrain: {global_batch: 8, seq_len: 16}\n"), self.token))
        self.assertIn("Ranked plans", plan)
        self.assertRegex(plan, r"dp \d+ x pp \d+ x tp \d+")
        self.assertRegex(plan, r'<ul class="explanation"><li>')

        for name, path, height in (("cluster.png", "/", 1500), ("jobs.png", "/jobs", 700),
                                   ("job.png", f"/job?id={self.job_id}", 2600),
                                   ("plan.png", "/plan?plan=1&spec=" + urllib.parse.quote(
                                       "name: planned\nmodel: {preset: gpt2}\n"
                                       "train: {global_batch: 32, seq_len: 1024, steps: 1000}\n"
                                       "parallel: {plan: auto}\n"), 1500)):
            self.browser.screenshot(with_token(self.url, path, self.token), name, height)

    def test_3_a_wrong_or_missing_token_sees_only_the_login_page(self):
        for url in (with_token(self.url, "/", "wrong-token"), with_token(self.url, f"/job?id={self.job_id}", "x"),
                    self.url + "jobs", self.url + f"job?id={self.job_id}", self.url + "plan"):
            dom = self.browser.dom(url)
            self.assertIn('action="/login"', dom, url)
            self.assertNotIn(self.job_id, dom, url)
            self.assertNotIn("site-a", dom, url)
        self.assertIn("That is not this cluster's token.", self.browser.dom(with_token(self.url, "/", "wrong")))
        self.browser.screenshot(with_token(self.url, "/", "wrong-token"), "login.png", 600)

    def test_4_http_needs_the_token_and_sets_a_strict_cookie(self):
        api = self.url + "api/jobs"
        self.assertEqual(http(api)[0], 401)
        self.assertEqual(http(api, {"Authorization": "Bearer wrong"})[0], 401)
        status, _, body = http(api, {"Authorization": "Bearer " + self.token})
        self.assertEqual(status, 200)
        self.assertIn(self.job_id, body)
        status, headers, _ = http(with_token(self.url, "/jobs", self.token))
        self.assertEqual(status, 303)
        self.assertEqual(headers["Location"], "/jobs")
        cookie = headers["Set-Cookie"]
        for attribute in ("HttpOnly", "SameSite=Strict", "Path=/"):
            self.assertIn(attribute, cookie)
        self.assertNotIn(self.token, cookie)
        session = cookie.split(";")[0]
        self.assertEqual(http(api, {"Cookie": session})[0], 200)
        origin = self.url.rstrip("/")
        cancel = json.dumps({"job_id": self.job_id}).encode()
        # The cookie alone, or from another site, does not cancel; from the dashboard's origin it reaches the API.
        for headers in ({"Cookie": session, "Content-Type": "application/json"},
                        {"Cookie": session, "Content-Type": "application/json", "Origin": "http://evil.example"}):
            self.assertEqual(http(self.url + "api/cancel", headers, cancel)[0], 403)
        status, _, body = http(self.url + "api/cancel", {"Cookie": session, "Content-Type": "application/json",
                                                         "Origin": origin}, cancel)
        self.assertIn(status, (200, 409), body)  # 409: it has ended already
        page = http(self.url + "jobs", {"Cookie": session})
        self.assertEqual(page[0], 200)
        self.assertIn("default-src 'none'", page[1]["Content-Security-Policy"])
        self.assertEqual(page[1]["X-Frame-Options"], "DENY")
        metrics = http(self.url + "metrics")
        self.assertEqual(metrics[0], 200)
        self.assertIn("geotrain_jobs", metrics[2])


class TlsDashboardTest(unittest.TestCase):
    def test_a_tls_head_serves_the_dashboard_over_https_only(self):
        home = tempfile.mkdtemp(prefix="geotrain_dashboard_tls_")
        head = None
        try:
            certs = os.path.join(home, "certs")
            subprocess.run(["bash", os.path.join(ROOT, "deploy", "make-certs.sh"), certs], check=True,
                           capture_output=True, timeout=120)
            env = dict(os.environ, GEOTRAIN_HOME=home)
            log = open(os.path.join(home, "head.log"), "w")
            head = subprocess.Popen([GEOTRAIN, "head", "start", "--state-dir", os.path.join(home, "head"), "--port",
                                     str(free_port()), "--metrics-port", str(free_port()),
                                     "--tls-cert", os.path.join(certs, "server.pem"),
                                     "--tls-key", os.path.join(certs, "server.key"),
                                     "--tls-ca", os.path.join(certs, "ca.pem")],
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            url = None
            for line in head.stdout:
                m = re.match(r"dashboard: (\S+) ", line)
                if m:
                    url = m.group(1)
                    break
            self.assertIsNotNone(url, "head start printed no dashboard URL")
            self.assertTrue(url.startswith("https://127.0.0.1:"), url)
            with open(os.path.join(home, "head", "token")) as f:
                token = f.read().strip()
            host, port = urllib.parse.urlsplit(url).netloc.split(":")
            # Plaintext HTTP to the HTTPS port: no HTTP answer at all.
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"GET /login HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(10)
                received = b""
                try:
                    while chunk := s.recv(4096):
                        received += chunk
                except (ConnectionResetError, socket.timeout):
                    pass
            self.assertNotIn(b"HTTP/1.1", received)
            context = ssl.create_default_context(cafile=os.path.join(certs, "ca.pem"))
            status, _, body = http(url + "login", context=context)
            self.assertEqual(status, 200)
            self.assertIn('action="/login"', body)
            self.assertEqual(http(url + "api/jobs", context=context)[0], 401)
            status, headers, _ = http(with_token(url, "/", token), context=context)
            self.assertEqual(status, 303)
            self.assertIn("; Secure", headers["Set-Cookie"])
            self.assertTrue(headers["Set-Cookie"].startswith("__Host-"))
            self.assertEqual(http(url + "api/cluster", {"Authorization": "Bearer " + token}, context=context)[0], 200)
        finally:
            if head is not None:
                head.terminate()
                try:
                    head.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    head.kill()
                    head.wait()
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    if CHROMIUM is None:
        print("SKIPPED: Chromium is not installed (Debian's `chromium` package; deploy/install-deps.sh installs it), "
              "so the dashboard cannot be tested in a browser")
        sys.exit(77)
    unittest.main(verbosity=2)
