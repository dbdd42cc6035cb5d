"""deploy/fabric/geotrain_fabric.py --dry-run for a 2-site x 2-node slice, without fablib.

Checks the plan it prints: the slice's nodes, GPUs and per-site FABNetv4 networks before submit; every node
addressed and routed; the package installed on every node before anything starts; the head started on the first
node, before any worker; each worker's env file naming that head, its own site and its own address; the ports
opened; the token sent only as a file and never on a command line or in the output. Without --dry-run and
without fablib it stops with one line saying how to install fablib.
Usage: fabric_dry_run_test.py PATH/TO/geotrain_fabric.py
"""
import os
import re
import secrets
import subprocess
import sys
import tempfile
import unittest

SCRIPT = sys.argv.pop(1)
NODES = [("UTAH", "utah-0"), ("UTAH", "utah-1"), ("STAR", "star-0"), ("STAR", "star-1")]


class FabricDryRunTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="geotrain_fabric_test_")
        cls.token = secrets.token_hex(16)
        cls.token_file = os.path.join(cls.dir.name, "token")
        with open(cls.token_file, "w") as f:
            f.write(cls.token + "\n")
        cls.deb = os.path.join(cls.dir.name, "geotrain_0.1.0_amd64.deb")
        open(cls.deb, "w").close()
        r = subprocess.run([sys.executable, SCRIPT, "--slice", "gt-test", "--sites", "UTAH,STAR", "--nodes-per-site",
                            "2", "--gpu", "GPU_A30", "--deb", cls.deb, "--token-file", cls.token_file, "--dry-run"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"dry run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        cls.out = r.stdout
        cls.lines = r.stdout.splitlines()

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def index(self, pattern, start=0):
        """Index of the first line at or after `start` that matches the regular expression."""
        for i in range(start, len(self.lines)):
            if re.search(pattern, self.lines[i]):
                return i
        self.fail(f"no line matches {pattern!r} after line {start}:\n{self.out}")

    def commands(self, node=None):
        prefix = f"[{node}] $ " if node else None
        return [line for line in self.lines if (line.startswith(prefix) if prefix else "] $ " in line)]

    def env_file(self, node, name):
        """The KEY=value lines the dry run shows for the env file `name` uploaded to `node`."""
        i = self.index(rf"^\[{node}\] upload .*{name}.* -> ")
        env = {}
        for line in self.lines[i + 1:]:
            if not line.startswith("    "):
                break
            key, value = line.strip().split("=", 1)
            env[key] = value
        return env

    def test_slice_is_built_then_submitted(self):
        submit = self.index(r"^fablib: slice\[gt-test\]\.submit\(\)")
        self.assertLess(self.index(r"new_slice\(name='gt-test'\)"), submit)
        for site, node in NODES:
            self.assertLess(self.index(rf"add_node\(name='{node}', site='{site}'"), submit)
            self.assertLess(self.index(rf"node\[{node}\]\.add_component\(model='GPU_A30'"), submit)
        for site in ("utah", "star"):
            self.assertLess(self.index(rf"add_l3network\(name='fabnet-{site}', .*type='IPv4'"), submit)
        for _, node in NODES:
            self.assertGreater(self.index(rf"node\[{node}\].*ip_addr_add\(addr="), submit)
            self.assertGreater(self.index(rf"node\[{node}\]\.ip_route_add\(subnet='10.128.0.0/10'"), submit)

    def test_head_on_first_node_and_workers_join_it_with_their_site(self):
        head_start = self.index(r"^\[utah-0\] \$ .*systemctl enable --now geotrain-head")
        self.assertEqual(len([c for c in self.commands() if "enable --now geotrain-head" in c]), 1)
        head_ip = re.search(r"ip_addr_add\(addr='([0-9.]+)'", self.lines[self.index(r"node\[utah-0\].*ip_addr_add")])
        head_address = f"{head_ip.group(1)}:6380"
        self.assertEqual(self.env_file("utah-0", "head.env")["GEOTRAIN_ADVERTISE_HOST"], head_ip.group(1))
        advertised = set()
        for site, node in NODES:
            env = self.env_file(node, "worker")
            self.assertEqual(env["GEOTRAIN_HEAD"], head_address, node)
            self.assertEqual(env["GEOTRAIN_SITE"], site.lower(), node)
            self.assertEqual(env["GEOTRAIN_TOKEN_FILE"], "/etc/geotrain/token", node)
            node_ip = re.search(r"ip_addr_add\(addr='([0-9.]+)'", self.lines[self.index(rf"node\[{node}\].*ip_addr_add")])
            self.assertEqual(env["GEOTRAIN_ADVERTISE_ADDRESS"], f"{node_ip.group(1)}:6381", node)
            advertised.add(env["GEOTRAIN_ADVERTISE_ADDRESS"])
            install = self.index(rf"^\[{node}\] \$ .*apt-get install -y -q ./geotrain.deb")
            self.assertLess(self.index(rf"^\[{node}\] upload .* -> geotrain.deb"), install)
            env_installed = self.index(rf"^\[{node}\] \$ sudo install .* /etc/geotrain/worker.env")
            worker_start = self.index(rf"^\[{node}\] \$ .*systemctl enable --now geotrain-worker")
            self.assertLess(install, env_installed)
            self.assertLess(env_installed, worker_start)
            self.assertLess(head_start, worker_start)
            self.assertLess(self.index(rf"^\[{node}\] \$ sudo install .* /etc/geotrain/token"), worker_start)
            self.assertLess(self.index(rf"^\[{node}\] \$ sudo .*open-ports.sh 10.128.0.0/10 .*6381 9471"), worker_start)
        self.assertEqual(len(advertised), 4)
        self.assertTrue(re.search(r"open-ports.sh 10.128.0.0/10 6380 9470 9090", self.out), "head ports not opened")

    def test_token_only_as_a_file(self):
        self.assertNotIn(self.token, self.out)
        for command in self.commands():
            self.assertNotRegex(command, r"--token(\s|=)", command)
            self.assertNotIn("GEOTRAIN_TOKEN=", command)
        for _, node in NODES:
            self.assertRegex(self.out, rf"\[{node}\] \$ sudo install -D -m 0600 -o geotrain -g geotrain \S+ "
                                       r"/etc/geotrain/token")

    def test_without_fablib_a_real_run_says_how_to_get_it(self):
        env = dict(os.environ, PYTHONPATH=self.dir.name)  # nothing named fabrictestbed_extensions there
        r = subprocess.run([sys.executable, SCRIPT, "--slice", "gt-test", "--sites", "UTAH", "--deb", self.deb],
                           capture_output=True, text=True, timeout=60, env=env)
        try:
            import fabrictestbed_extensions  # noqa: F401
            self.skipTest("fablib is installed here")
        except ImportError:
            pass
        self.assertEqual(r.returncode, 1)
        self.assertIn("pip install fabrictestbed-extensions", r.stderr)
        self.assertIn("--dry-run", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
