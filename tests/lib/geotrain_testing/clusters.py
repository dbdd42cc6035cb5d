"""Real geotrain processes on loopback, for integration tests and benchmarks: the one cluster harness.

A ClusterUp runs `geotrain cluster up TOPOLOGY` in its own GEOTRAIN_HOME and can kill -9 and restart any of
its processes. A LocalCluster owns a temporary GEOTRAIN_HOME and state dir, starts `geotrain head start` and
`geotrain worker start` as child processes, and kills everything it started when closed. Both also close at
interpreter exit, so that a test whose set-up fails (where unittest calls no tearDown) leaves nothing behind.
Benchmarks that bring several clusters up and down in turn in one home (bench/geo/) take private_cluster_env
and run: the same private environment as ClusterUp's (private_env), their commands' failures raised as
RuntimeError with the output's tail.
"""
import atexit
import json
import os
import re
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


def pss_bytes(pid):
    """Proportional set size of a process (shared pages divided among their mappings), or 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def wait_for(predicate, timeout, what, interval=0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def private_env(home, **extra):
    """This process's environment with GEOTRAIN_HOME=home and `extra`, and no inherited head or token
    (GEOTRAIN_HEAD, GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE), so that the CLI talks only to the cluster whose record
    is in `home`."""
    env = dict(os.environ, GEOTRAIN_HOME=home, **extra)
    for name in ("GEOTRAIN_HEAD", "GEOTRAIN_TOKEN", "GEOTRAIN_TOKEN_FILE"):
        env.pop(name, None)
    return env


def private_cluster_env(prefix, **extra):
    """A fresh work directory (mkdtemp with `prefix`; the caller removes it) and a private_env whose
    GEOTRAIN_HOME is work/home, for a benchmark that runs `cluster up` and `cluster down` itself."""
    work = tempfile.mkdtemp(prefix=prefix)
    return work, private_env(os.path.join(work, "home"), **extra)


def run(cmd, env, timeout=900):
    """Runs cmd in env; returns its stdout. Raises RuntimeError with the tails of its output when it exits non-zero
    (subprocess.TimeoutExpired when it outlasts `timeout` seconds)."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout



def process_logs(state_dir):
    """The last 3,000 characters of each process log of a `cluster up` state dir (<state_dir>/logs/*)."""
    out = []
    logs = os.path.join(state_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            out.append(f"==== {name}\n{f.read()[-3000:]}")
    return "\n".join(out)

class LocalCluster:
    def __init__(self, geotrain, heartbeat_args=()):
        self.geotrain = geotrain
        self.dir = tempfile.mkdtemp(prefix="geotrain_it_")
        self.state_dir = os.path.join(self.dir, "state")
        self.env = private_env(os.path.join(self.dir, "home"))
        self.port = free_port()
        self.metrics_port = free_port()
        self.heartbeat_args = list(heartbeat_args)
        self.head = None
        self.workers = {}
        self.procs = []
        atexit.register(self.close)

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

    def start_worker(self, name, site, devices=(), extra_args=()):
        args = ["worker", "start", "--site", site, "--worker-id", name, "--metrics-port", "-1",
                "--probe-interval-ms", "1000"] + list(extra_args)
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


class ClusterUp:
    """A `geotrain cluster up TOPOLOGY` cluster in its own GEOTRAIN_HOME, whose processes (named as in
    cluster.json: "head", "worker NAME", ...) can be killed with -9 and started again with the same command."""

    def __init__(self, geotrain, topology, prefix="geotrain_cluster_", up_args=()):
        self.geotrain = geotrain
        self.home = tempfile.mkdtemp(prefix=prefix)
        self.env = private_env(self.home)
        self.state = os.path.join(self.home, "cluster")
        self.restarted = {}  # name -> Popen of a process the test started again
        self.killed = {}     # name -> (argv, env) to start it again
        self.closed = False
        atexit.register(self.close)
        self.up = self.cli(["cluster", "up", topology] + list(up_args)).stdout

    def cli(self, args, check=True, timeout=120):
        r = subprocess.run([self.geotrain] + args, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"geotrain {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def pids(self):
        with open(os.path.join(self.state, "cluster.json")) as f:
            record = f.read()
        pids = {name: int(pid) for name, pid in re.findall(r'"name": "([^"]+)", "pid": "(\d+)"', record)}
        for name, p in self.restarted.items():
            pids[name] = p.pid
        return pids

    def netem_port(self):
        with open(os.path.join(self.state, "cluster.json")) as f:
            return int(re.search(r'"netem_control_port": "(\d+)"', f.read()).group(1))

    def kill(self, name):
        pid = self.pids()[name]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
        os.kill(pid, signal.SIGKILL)
        if name in self.restarted:
            self.restarted.pop(name).wait()
        self.killed[name] = (argv, env)
        return time.monotonic()

    def restart(self, name):
        argv, env = self.killed.pop(name)
        with open(os.path.join(self.state, "logs", name.replace(" ", "-") + "-again.log"), "ab") as log:
            self.restarted[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True)

    def netem(self, command):
        with socket.create_connection(("127.0.0.1", self.netem_port()), timeout=5) as s:
            s.sendall((command + "\n").encode())
            reply = b""
            while not reply.endswith(b"ok\n") and b"error" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.endswith(b"ok\n"), reply

    def job(self, job_id):
        return json.loads(self.cli(["job", "status", job_id, "--json"]).stdout)

    def logs(self, job_id):
        return self.cli(["job", "logs", job_id]).stdout

    def wait_job(self, job_id, timeout=300):
        """The job's status once it has ended. Follows its log (`job logs --follow`: one process, which the head
        answers as the job goes) rather than asking for its status again and again: while geotrain linked cuBLAS,
        each process took about 0.6 s of CPU to start here (0.05 s since it opens cuBLAS on first use), so polling
        every 0.3 s took a third of this 2-core machine from the jobs it waited for, and timed studies measured the
        poller too. When the stream breaks before the job ends (the head restarting), follows it again."""
        deadline = time.monotonic() + timeout

        def ended():
            r = self.cli(["job", "status", job_id, "--json"], check=False)
            if r.returncode != 0:
                return None  # the head is restarting
            j = json.loads(r.stdout)
            return j if j["state"] in ("JOB_SUCCEEDED", "JOB_FAILED", "JOB_CANCELLED") else None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {job_id} to end")
            try:
                self.cli(["job", "logs", job_id, "--follow"], check=False, timeout=left)
            except subprocess.TimeoutExpired:
                pass
            job = ended()
            if job:
                return job
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def wait_log(self, job_id, pattern, timeout=120):
        return wait_for(lambda: re.search(pattern, self.logs(job_id)), timeout, f"'{pattern}' in {job_id}'s log", 0.2)

    def process_logs(self):
        return process_logs(self.state)

    def close(self):
        if self.closed:
            return
        self.closed = True
        for p in self.restarted.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.cli(["cluster", "down"], check=False)
        if os.environ.get("GEOTRAIN_KEEP_TEST_DIR"):
            print(f"kept {self.home}")
        else:
            shutil.rmtree(self.home, ignore_errors=True)
