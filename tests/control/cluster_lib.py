"""Helpers for integration tests that run real geotrain processes on loopback.

A LocalCluster owns a temporary GEOTRAIN_HOME and state dir, starts `geotrain head start` and
`geotrain worker start` as child processes, and kills everything it started when closed.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout, what, interval=0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class LocalCluster:
    def __init__(self, geotrain, heartbeat_args=()):
        self.geotrain = geotrain
        self.dir = tempfile.mkdtemp(prefix="geotrain_it_")
        self.state_dir = os.path.join(self.dir, "state")
        self.env = dict(os.environ)
        self.env["GEOTRAIN_HOME"] = os.path.join(self.dir, "home")
        self.env.pop("GEOTRAIN_HEAD", None)
        self.env.pop("GEOTRAIN_TOKEN", None)
        self.port = free_port()
        self.metrics_port = free_port()
        self.heartbeat_args = list(heartbeat_args)
        self.head = None
        self.workers = {}
        self.procs = []

    def _spawn(self, args, log_name):
        with open(os.path.join(self.dir, log_name), "ab") as log:
            p = subprocess.Popen([self.geotrain] + args, stdout=log, stderr=subprocess.STDOUT,
                                 env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def start_head(self):
        self.head = self._spawn(["head", "start", "--port", str(self.port), "--metrics-port",
                                 str(self.metrics_port), "--state-dir", self.state_dir]
                                + self.heartbeat_args, "head.log")
        wait_for(lambda: self.cli(["status", "--json"], check=False).returncode == 0, 15, "the head")
        return self.head

    def start_worker(self, name, site, devices=()):
        args = ["worker", "start", "--site", site, "--worker-id", name, "--metrics-port", "-1",
                "--probe-interval-ms", "1000"]
        for d in devices:
            args += ["--emulate-device", d]
        self.workers[name] = self._spawn(args, f"worker-{name}.log")
        return self.workers[name]

    def cli(self, args, check=True, env=None, timeout=None):
        # Following a job lasts as long as the job; everything else answers within seconds.
        if timeout is None:
            timeout = 600 if "--follow" in args else 60
        r = subprocess.run([self.geotrain] + args, capture_output=True, text=True, timeout=timeout,
                           env=env or self.env)
        if check and r.returncode != 0:
            raise AssertionError(f"geotrain {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def status(self):
        return json.loads(self.cli(["status", "--json"]).stdout)

    def worker_states(self):
        return {w["worker_id"]: w["state"] for w in self.status().get("workers", [])}

    def token(self):
        with open(os.path.join(self.state_dir, "token")) as f:
            return f.read().strip()

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f"==== {name}\n{f.read()[-4000:]}")
        return "\n".join(out)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
