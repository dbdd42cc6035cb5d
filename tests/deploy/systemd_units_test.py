"""The installed systemd units (PREFIX/share/geotrain/systemd), checked and run as systemd would run them.

`systemd-analyze verify` checks both units. Then each unit's Environment= defaults, an env file written from the
installed template, and its ExecStart are expanded with systemd's rules (systemd.exec(5): `${VAR}` stays one
word, a bare `$VAR` word splits on spaces, `%H` is the host name), and the resulting head and worker run as real
processes on loopback with that environment: the worker joins with its site, the token comes only from the token
file (on no command line), and the CLI finds the head from GEOTRAIN_HEAD and GEOTRAIN_TOKEN_FILE alone; the worker
unit's stop (SIGTERM, with time for a drain) ends the worker with status 0.
Usage: systemd_units_test.py PREFIX
"""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import unittest

from geotrain_testing.clusters import free_port, wait_for

PREFIX = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 else "/usr"
UNITS = os.path.join(PREFIX, "share", "geotrain", "systemd")
GEOTRAIN = os.path.join(PREFIX, "bin", "geotrain")


def read_service_section(path):
    """The [Service] settings of a unit file: key -> list of values, continuation lines joined."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    settings, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def read_env_file(path):
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value
    return env


def expand_exec(command, env):
    """systemd's ExecStart expansion: a word that is exactly $VAR becomes the value split on whitespace (zero
    words when empty); ${VAR} inside a word is replaced by the value, and the word stays one argument."""
    argv = []
    for word in command.split():
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            argv += env.get(bare.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


class SystemdUnitsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="geotrain_units_")
        self.procs = []
        self.token = secrets.token_hex(16)
        self.token_file = self.write("token", self.token + "\n", 0o600)

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if hasattr(self, "_outcome") and not self._outcome.success:
            for name in sorted(os.listdir(self.dir)):
                if name.endswith(".log"):
                    with open(os.path.join(self.dir, name), errors="replace") as f:
                        print(f"==== {name}\n{f.read()[-3000:]}")
        shutil.rmtree(self.dir, ignore_errors=True)

    def write(self, name, text, mode=0o644):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        return path

    def env_file_from_template(self, template, values):
        """The installed template with some values set, as an operator would edit it."""
        lines = []
        with open(os.path.join(UNITS, template)) as f:
            for line in f:
                key = line.split("=", 1)[0].lstrip("# ").strip()
                lines.append(line if key not in values else f"{key}={values.pop(key)}\n")
        lines += [f"{k}={v}\n" for k, v in values.items()]
        return self.write(template, "".join(lines))

    def start_unit(self, unit, env_file):
        service = read_service_section(os.path.join(UNITS, unit))
        self.assertEqual(service["Restart"], ["on-failure"])
        self.assertEqual(service["EnvironmentFile"], [f"/etc/geotrain/{unit.split('-')[1].split('.')[0]}.env"])
        unit_env = {}
        for assignment in service["Environment"]:
            key, value = assignment.split("=", 1)
            unit_env[key] = value.replace("%H", socket.gethostname())
        unit_env.update(read_env_file(env_file))  # EnvironmentFile= overrides Environment=
        argv = expand_exec(service["ExecStart"][0], unit_env)
        self.assertEqual(argv[0], GEOTRAIN)
        self.assertNotIn("--token", argv)
        self.assertNotIn(self.token, " ".join(argv))
        process_env = {k: v for k, v in os.environ.items() if not k.startswith("GEOTRAIN_")}
        process_env.update(unit_env)
        with open(os.path.join(self.dir, unit + ".log"), "wb") as log:
            p = subprocess.Popen(argv, env=process_env, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def cli(self, args, token_file):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEOTRAIN_")}
        env.update(GEOTRAIN_HEAD=self.head_address, GEOTRAIN_TOKEN_FILE=token_file,
                   GEOTRAIN_HOME=os.path.join(self.dir, "cli-home"))
        return subprocess.run([GEOTRAIN] + args, env=env, capture_output=True, text=True, timeout=30)

    def test_units_verify(self):
        if not shutil.which("systemd-analyze"):
            self.skipTest("systemd-analyze is not installed")
        for unit in ("geotrain-head.service", "geotrain-worker.service"):
            r = subprocess.run(["systemd-analyze", "verify", os.path.join(UNITS, unit)], capture_output=True,
                               text=True)
            self.assertEqual(r.returncode, 0, f"{unit}: {r.stdout}{r.stderr}")

    def test_head_and_worker_from_units(self):
        head_port, worker_port = free_port(), free_port()
        self.head_address = f"127.0.0.1:{head_port}"
        state_dir = os.path.join(self.dir, "state")
        head_env = self.env_file_from_template("head.env", {
            "GEOTRAIN_TOKEN_FILE": self.token_file, "GEOTRAIN_ADVERTISE_HOST": "127.0.0.1",
            "GEOTRAIN_BIND": "127.0.0.1", "GEOTRAIN_HEAD_PORT": head_port, "GEOTRAIN_METRICS_PORT": free_port(),
            "GEOTRAIN_STATE_DIR": state_dir, "GEOTRAIN_HOME": os.path.join(self.dir, "head-home")})
        worker_env = self.env_file_from_template("worker.env", {
            "GEOTRAIN_HEAD": self.head_address, "GEOTRAIN_SITE": "utah", "GEOTRAIN_TOKEN_FILE": self.token_file,
            "GEOTRAIN_ADVERTISE_ADDRESS": f"127.0.0.1:{worker_port}", "GEOTRAIN_BIND": "127.0.0.1",
            "GEOTRAIN_WORKER_PORT": worker_port, "GEOTRAIN_METRICS_PORT": free_port(),
            "GEOTRAIN_HOME": os.path.join(self.dir, "worker-home"),
            "GEOTRAIN_WORKER_ARGS": "--emulate-device T4:65:16 --probe-interval-ms 0"})

        head = self.start_unit("geotrain-head.service", head_env)
        wait_for(lambda: head.poll() is not None or self.cli(["status"], self.token_file).returncode == 0, 20,
                 "the head")
        self.assertIsNone(head.poll(), "the head exited")
        worker = self.start_unit("geotrain-worker.service", worker_env)

        def joined():
            status = json.loads(self.cli(["status", "--json"], self.token_file).stdout)
            return [w for w in status.get("workers", []) if w.get("state") == "WORKER_ALIVE"]
        workers = wait_for(joined, 20, "the worker to join")
        self.assertEqual(len(workers), 1)
        self.assertEqual(workers[0]["site"], "utah")
        self.assertEqual(workers[0]["worker_id"], socket.gethostname())  # the unit's default, %H
        self.assertEqual(workers[0]["devices"][0]["name"], "T4")  # GEOTRAIN_WORKER_ARGS, split into words

        # The head took the token from the file; neither process has it on its command line.
        with open(os.path.join(state_dir, "token")) as f:
            self.assertEqual(f.read().strip(), self.token)
        for p in (head, worker):
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                self.assertNotIn(self.token.encode(), f.read())

        # `systemctl stop` sends KillSignal and waits TimeoutStopSec, above the worker's drain timeout (120 s): a
        # worker without actors drains at once and exits 0.
        service = read_service_section(os.path.join(UNITS, "geotrain-worker.service"))
        self.assertEqual(service["KillSignal"], ["SIGTERM"])
        stop_seconds = int(service["TimeoutStopSec"][0].rstrip("s"))
        self.assertGreater(stop_seconds, 120)

        wrong = self.write("wrong-token", "not-the-token\n", 0o600)
        r = self.cli(["status"], wrong)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("wrong cluster token", r.stderr)
        missing = os.path.join(self.dir, "no-such-token")
        r = self.cli(["status"], missing)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(missing, r.stderr)
        self.assertIn("GEOTRAIN_TOKEN_FILE", r.stderr)

        worker.send_signal(signal.SIGTERM)
        self.assertEqual(worker.wait(timeout=stop_seconds), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
