"""deploy/fabric/geotrain_fabric.py --dry-run, without fablib, for a 2-site x 2-node slice given with the
shorthand flags and for a three-site slice of mixed GPUs given site by site (--site), with no .deb built.

Checks the plan it prints: the slice's nodes, GPUs and per-site FABNetv4 networks before submit; every node
addressed and routed; the package installed on every node before anything starts; the head started on the first
node, before any worker; each worker's env file naming that head, its own site, its own address and the fixed
ports; the ports opened; the token sent only as a file and never on a command line or in the output; the secrets
directory (0700) and its token (0600) kept after the run and reused by the next; the SSH tunnel command with the
slice key, the bastion and the ports. Bad --site values and mixed flag forms stop with a message naming them.
The steps only a real run takes are checked through a run without --dry-run against a stand-in for fablib that
answers `status --json` with made-up workers: the head's view compared with the plan (exit status 3 when they
differ), cluster.json with the printed tunnel for the notebook (which --delete reads to drain every worker before
the slice goes), and the TLS files made by deploy/make-certs.sh (openssl) kept private, an earlier run's kept. Without --dry-run and without fablib it stops with one line saying
how to install fablib.
Every run gets a temporary HOME, so the default secrets directory (~/.geotrain/SLICE) lands there.
Usage: fabric_dry_run_test.py PATH/TO/geotrain_fabric.py
"""
import ast
import importlib.util
import json
import os
import re
import secrets
import shlex
import stat
import subprocess
import sys
import tempfile
import unittest

SCRIPT = sys.argv.pop(1)
NODES = [("UTAH", "utah-0"), ("UTAH", "utah-1"), ("STAR", "star-0"), ("STAR", "star-1")]


def run_script(args, home, **kwargs):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, HOME=home, **kwargs.pop("env", {})), **kwargs)


def load_script():
    spec = importlib.util.spec_from_file_location("geotrain_fabric", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PlanOutput:
    """Helpers over the lines a dry run printed (self.out, self.lines)."""

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

    def node_ip(self, node):
        line = self.lines[self.index(rf"node\[{node}\].*ip_addr_add")]
        return re.search(r"ip_addr_add\(addr='([0-9.]+)'", line).group(1)


class FabricDryRunTest(PlanOutput, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="geotrain_fabric_test_")
        cls.token = secrets.token_hex(16)
        cls.token_file = os.path.join(cls.dir.name, "token")
        with open(cls.token_file, "w") as f:
            f.write(cls.token + "\n")
        cls.deb = os.path.join(cls.dir.name, "geotrain_0.1.0_amd64.deb")
        open(cls.deb, "w").close()
        r = run_script(["--slice", "gt-test", "--sites", "UTAH,STAR", "--nodes-per-site", "2", "--gpu", "GPU_A30",
                        "--deb", cls.deb, "--token-file", cls.token_file, "--dry-run"], cls.dir.name)
        assert r.returncode == 0, f"dry run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        cls.out = r.stdout
        cls.lines = r.stdout.splitlines()

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

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
                           capture_output=True, text=True, timeout=60, env=dict(env, HOME=self.dir.name))
        try:
            import fabrictestbed_extensions  # noqa: F401
            self.skipTest("fablib is installed here")
        except ImportError:
            pass
        self.assertEqual(r.returncode, 1)
        self.assertIn("pip install fabrictestbed-extensions", r.stderr)
        self.assertIn("--dry-run", r.stderr)

    def test_secrets_dir_kept_and_token_file_used_as_given(self):
        secrets_dir = os.path.join(self.dir.name, ".geotrain", "gt-test")
        self.assertEqual(stat.S_IMODE(os.stat(secrets_dir).st_mode), 0o700)
        self.assertFalse(os.path.exists(os.path.join(secrets_dir, "token")), "--token-file was given: no new token")
        self.assertIn(f"cluster token from {self.token_file} (--token-file)", self.out)


class MixedSitesDryRunTest(PlanOutput, unittest.TestCase):
    """Three sites, each its own GPU model, node count and GPUs per node; no .deb; no --secrets-dir."""
    SITES = {"UTAH": ("RTX6000", "GPU_RTX6000", 2, 1), "TACC": ("A30", "GPU_A30", 1, 1),
             "STAR": ("T4", "GPU_TeslaT4", 2, 2)}
    SLICE_KEY = "/keys/fabric slice_key"  # a space: the printed command must quote it

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="geotrain_fabric_mixed_")
        cls.deb = os.path.join(cls.dir.name, "build", "geotrain_0.1.0_amd64.deb")  # never built
        cls.args = ["--slice", "gt-mixed", "--site", "UTAH:RTX6000:2", "--site", "tacc:a30:1", "--site",
                    "STAR:Tesla T4:2:2", "--deb", cls.deb, "--bastion-user", "alice_0001", "--slice-key",
                    cls.SLICE_KEY, "--dry-run"]
        r = run_script(cls.args, cls.dir.name)
        assert r.returncode == 0, f"dry run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        cls.out, cls.lines = r.stdout, r.stdout.splitlines()
        cls.secrets_dir = os.path.join(cls.dir.name, ".geotrain", "gt-mixed")

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def nodes(self, site):
        return [f"{site.lower()}-{i}" for i in range(self.SITES[site][2])]

    def test_plan_has_each_sites_nodes_and_gpus(self):
        submit = self.index(r"^fablib: slice\[gt-mixed\]\.submit\(\)")
        for site, (gpu, component, nodes, gpus) in self.SITES.items():
            names = ", ".join(self.nodes(site))
            self.index(rf"^  site {site}: {nodes} nodes? x {gpus} {gpu} \({component}\): {names}$")
            for node in self.nodes(site):
                self.assertLess(self.index(rf"add_node\(name='{node}', site='{site}'"), submit)
                added = re.findall(rf"^fablib: node\[{node}\]\.add_component\(model='(GPU_\w+)', name='gpu(\d)'\)",
                                   self.out, re.M)
                self.assertEqual(added, [(component, str(g)) for g in range(gpus)], node)
            self.assertNotRegex(self.out, rf"add_node\(name='{site.lower()}-{nodes}'")  # no extra node
            network = self.index(rf"add_l3network\(name='fabnet-{site.lower()}', interfaces='<{nodes} interfaces>'")
            self.assertLess(network, submit)
        self.index(r"^== plan: 3 sites, 5 nodes, 7 GPUs; the head on utah-0")

    def test_workers_join_the_head_with_their_site_and_fixed_ports(self):
        head_ip = self.node_ip("utah-0")
        self.assertEqual(self.env_file("utah-0", "head.env")["GEOTRAIN_ADVERTISE_HOST"], head_ip)
        self.assertEqual(len([c for c in self.commands() if "enable --now geotrain-head" in c]), 1)
        for site in self.SITES:
            for node in self.nodes(site):
                env = self.env_file(node, "worker")
                self.assertEqual(env["GEOTRAIN_HEAD"], f"{head_ip}:6380", node)
                self.assertEqual(env["GEOTRAIN_SITE"], site.lower(), node)
                self.assertEqual(env["GEOTRAIN_ADVERTISE_ADDRESS"], f"{self.node_ip(node)}:6381", node)
                self.assertEqual((env["GEOTRAIN_WORKER_PORT"], env["GEOTRAIN_METRICS_PORT"]), ("6381", "9471"), node)
                # The worker offers the GPUs it detects: nothing makes it stand in for a device.
                self.assertNotIn("GEOTRAIN_WORKER_ARGS", env, node)
                self.index(rf"^\[{node}\] \$ sudo .*open-ports.sh 10.128.0.0/10 .*6381 9471$")
        for command in self.commands():
            self.assertNotIn("--emulate-device", command)
        self.assertNotIn("GEOTRAIN_WORKER_ARGS", self.out)

    def test_without_the_deb_it_says_it_would_upload_it(self):
        self.assertFalse(os.path.exists(self.deb))
        self.index(rf"^local: \(dry run\) {re.escape(self.deb)} does not exist; a real run uploads it")
        for site in self.SITES:
            for node in self.nodes(site):
                self.assertLess(self.index(rf"^\[{node}\] upload {re.escape(self.deb)} .*-> geotrain.deb$"),
                                self.index(rf"^\[{node}\] \$ .*apt-get install -y -q ./geotrain.deb"))
        r = run_script([a for a in self.args if a != "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"--deb: no such package {self.deb!r}", r.stderr)

    def test_secrets_dir_is_private_kept_and_reused(self):
        self.assertEqual(stat.S_IMODE(os.stat(self.secrets_dir).st_mode), 0o700)
        token_path = os.path.join(self.secrets_dir, "token")
        self.assertEqual(stat.S_IMODE(os.stat(token_path).st_mode), 0o600)
        with open(token_path) as f:
            token = f.read().strip()
        self.assertRegex(token, r"^[0-9a-f]{32}$")
        self.index(rf"^local: new cluster token in {re.escape(token_path)} \(mode 0600\)")
        self.index(rf"^== secrets in {re.escape(self.secrets_dir)} \(kept\)")
        # A second run reuses the token instead of making one the nodes and the user do not have.
        again = run_script(self.args, self.dir.name)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn(f"reusing the cluster token in {token_path}", again.stdout)
        with open(token_path) as f:
            self.assertEqual(f.read().strip(), token)

    def test_token_never_on_a_command_line_or_in_the_output(self):
        with open(os.path.join(self.secrets_dir, "token")) as f:
            token = f.read().strip()
        self.assertNotIn(token, self.out)
        for command in self.commands():
            self.assertNotRegex(command, r"--token(\s|=)", command)
            self.assertNotIn("GEOTRAIN_TOKEN=", command)
        for site in self.SITES:
            for node in self.nodes(site):
                self.index(rf"^\[{node}\] \$ sudo install -D -m 0600 -o geotrain -g geotrain \S+ /etc/geotrain/token")

    def test_tunnel_command_with_slice_key_bastion_and_ports(self):
        head_ip = self.node_ip("utah-0")
        i = self.index(r"^== SSH tunnel: .* through the FABRIC bastion bastion.fabric-testbed.net")
        with_config = shlex.split(self.lines[i + 1])
        explicit = shlex.split(self.lines[self.index(r"^or, without fablib's ssh_config", i) + 1])
        forwards = ["6380:" + head_ip + ":6380", "9470:" + head_ip + ":9470", "9090:127.0.0.1:9090"]
        for argv in (with_config, explicit):
            self.assertEqual(argv[:3], ["ssh", "-i", self.SLICE_KEY], argv)
            self.assertEqual([argv[k + 1] for k, a in enumerate(argv) if a == "-L"], forwards, argv)
            self.assertIn("-N", argv)
            self.assertEqual(argv[-1], "debian@<management IP of utah-0>")
        config = with_config[with_config.index("-F") + 1]
        self.assertEqual(config, os.path.join(self.dir.name, "work", "fabric_config", "ssh_config"))
        proxy = [a for a in explicit if a.startswith("ProxyCommand=")]
        self.assertEqual(len(proxy), 1, explicit)
        self.assertRegex(proxy[0], r"^ProxyCommand=ssh -i \S*fabric_bastion_key -W \[%h\]:%p "
                                   r"alice_0001@bastion.fabric-testbed.net$")
        token_file = re.escape(os.path.join(self.secrets_dir, "token"))
        self.index(rf"GEOTRAIN_HEAD=127.0.0.1:6380 GEOTRAIN_TOKEN_FILE={token_file} geotrain status")


class SecretsAndTlsDryRunTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="geotrain_fabric_secrets_")
        self.addCleanup(self.dir.cleanup)

    def test_tls_files_go_to_the_named_secrets_dir(self):
        secrets_dir = os.path.join(self.dir.name, "my secrets")
        r = run_script(["--slice", "gt-tls", "--site", "UTAH:A40:1", "--secrets-dir", secrets_dir, "--tls",
                        "--dry-run"], self.dir.name, env={"FABRIC_BASTION_USERNAME": "bob_0002"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(stat.S_IMODE(os.stat(secrets_dir).st_mode), 0o700)
        self.assertFalse(os.path.exists(os.path.join(self.dir.name, ".geotrain", "gt-tls")))
        self.assertRegex(r.stdout, rf"local: bash \S*make-certs.sh '{re.escape(secrets_dir)}/tls' 10.128.1.2\n")
        self.assertIn(f"CA {secrets_dir}/tls/ca.pem", r.stdout)
        self.assertIn(f"GEOTRAIN_TOKEN_FILE={shlex.quote(secrets_dir + '/token')} "
                      f"GEOTRAIN_TLS_CA={shlex.quote(secrets_dir + '/tls/ca.pem')} geotrain status", r.stdout)
        self.assertIn("bob_0002@bastion.fabric-testbed.net", r.stdout)
        self.assertIn("add_component(model='GPU_A40', name='gpu0')", r.stdout)

    def test_an_open_secrets_dir_is_refused(self):
        secrets_dir = os.path.join(self.dir.name, "open")
        os.mkdir(secrets_dir)
        os.chmod(secrets_dir, 0o755)
        r = run_script(["--slice", "gt", "--site", "UTAH:T4:1", "--secrets-dir", secrets_dir, "--dry-run"],
                       self.dir.name)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn(f"chmod 700 {secrets_dir}", r.stderr)
        self.assertEqual(os.listdir(secrets_dir), [])

    def test_bad_site_descriptions_name_the_value_and_the_form(self):
        cases = {
            "UTAH:RTX6000": "'UTAH:RTX6000' has 2 part(s); expected NAME:GPU_MODEL:NODES[:GPUS_PER_NODE]",
            "UTAH:RTX6000:0": "NODES '0' is not a whole number of at least 1",
            "UTAH:RTX6000:2:x": "GPUS_PER_NODE 'x' is not a whole number of at least 1",
            "UT-AH:T4:1": "'UT-AH' is not a FABRIC site name",
            "UTAH:A100:1": "FABRIC has no A100 GPU to add to a node; its GPUs are RTX6000 (GPU_RTX6000)",
            "UTAH:B9000:1": "unknown GPU model 'B9000'",
        }
        for value, message in cases.items():
            r = run_script(["--slice", "gt", "--site", value, "--dry-run"], self.dir.name)
            self.assertEqual(r.returncode, 2, value)
            self.assertIn("argument --site:", r.stderr, value)
            self.assertIn(message, r.stderr, value)
        self.assertFalse(os.path.exists(os.path.join(self.dir.name, ".geotrain")), "nothing made on a bad argument")

    def test_mixed_forms_duplicate_sites_and_no_sites_are_refused(self):
        r = run_script(["--slice", "gt", "--site", "UTAH:T4:1", "--gpu", "A30", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--site describes each site in full; drop --gpu", r.stderr)
        r = run_script(["--slice", "gt", "--site", "UTAH:T4:1", "--site", "utah:A30:1", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 2)
        self.assertIn("site UTAH is given twice", r.stderr)
        r = run_script(["--slice", "gt", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 2)
        self.assertIn("describe the sites: --site NAME:GPU_MODEL:NODES[:GPUS_PER_NODE]", r.stderr)
        r = run_script(["--slice", "gt", "--sites", "UTAH", "--gpu", "L40S", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--gpu: FABRIC has no L40S GPU", r.stderr)


# A stand-in for fablib for a run without --dry-run: the dry run's objects, except that the head answers
# `geotrain status --json` with the file FAKE_STATUS_JSON names, as a real head would with what the workers registered.
FAKE_FABLIB = """
import importlib.util, os
spec = importlib.util.spec_from_file_location("geotrain_fabric_under_test", os.environ["GEOTRAIN_FABRIC_SCRIPT"])
fabric = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fabric)


class Node(fabric.DryRunNode):
    def execute(self, command, quiet=False):
        out = ""
        if "status --json" in command:
            with open(os.environ["FAKE_STATUS_JSON"]) as f:
                out = f.read()
        return out + fabric.EXIT_MARK + "0\\n", ""


class Slice(fabric.DryRunSlice):
    def add_node(self, name, **kwargs):
        super().add_node(name, **kwargs)
        self._nodes[name] = Node(name)
        return self._nodes[name]


class FablibManager(fabric.DryRunFablib):
    def new_slice(self, name):
        return Slice(name)

    def get_bastion_username(self):
        return "carol_0003"
"""


class RealRunWithFakeFablibTest(unittest.TestCase):
    """The steps a dry run only announces: the head's view against the plan, and cluster.json for the notebook."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="geotrain_fabric_real_")
        self.addCleanup(self.dir.cleanup)
        package = os.path.join(self.dir.name, "fake", "fabrictestbed_extensions", "fablib")
        os.makedirs(package)
        for init in (os.path.dirname(package), package):
            open(os.path.join(init, "__init__.py"), "w").close()
        with open(os.path.join(package, "fablib.py"), "w") as f:
            f.write(FAKE_FABLIB)
        self.deb = os.path.join(self.dir.name, "geotrain_0.1.0_amd64.deb")
        open(self.deb, "w").close()

    def run_with_status(self, workers, *extra):
        status_file = os.path.join(self.dir.name, "status.json")
        with open(status_file, "w") as f:
            f.write(json.dumps({"workers": workers}, indent=2) + "\n")  # as `geotrain status --json` prints it
        env = {"PYTHONPATH": os.path.join(self.dir.name, "fake"), "GEOTRAIN_FABRIC_SCRIPT": os.path.abspath(SCRIPT),
               "FAKE_STATUS_JSON": status_file}
        return run_script(["--slice", "gt-real", "--site", "UTAH:RTX6000:1", "--site", "STAR:T4:1:2", "--deb",
                           self.deb, *extra], self.dir.name, env=env)

    @staticmethod
    def worker(worker_id, site, *names, kind="DEVICE_KIND_CUDA"):
        return {"worker_id": worker_id, "site": site, "state": "WORKER_ALIVE",
                "devices": [{"kind": kind, "name": n, "memory_bytes": str(16 << 30)} for n in names]}

    def test_the_planned_cluster_passes_and_leaves_the_tunnel_for_the_notebook(self):
        star = self.worker("star-0", "star", "Tesla T4", "Tesla T4")
        for device in star["devices"]:
            device["compute_capability"] = 75  # as a head that reports it prints it
        r = self.run_with_status([self.worker("utah-0", "utah", "Quadro RTX 6000"), star])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("  site star: 1 alive workers, 2 GPUs: 2 x Tesla T4 (16.0 GiB, compute capability 7.5)", r.stdout)
        self.assertIn("  site utah: 1 alive workers, 1 GPUs: 1 x Quadro RTX 6000 (16.0 GiB)", r.stdout)
        self.assertNotIn("differs from the plan", r.stdout)
        record_path = os.path.join(self.dir.name, ".geotrain", "gt-real", "cluster.json")
        self.assertEqual(stat.S_IMODE(os.stat(record_path).st_mode), 0o600)
        with open(record_path) as f:
            record = json.load(f)
        self.assertEqual(record["head"], "10.128.1.2:6380")
        self.assertEqual(record["token_file"], os.path.join(self.dir.name, ".geotrain", "gt-real", "token"))
        lines = r.stdout.splitlines()
        printed = shlex.split(lines[next(i for i, l in enumerate(lines) if l.startswith("== SSH tunnel")) + 1])
        self.assertEqual(record["tunnel"], printed)
        bastion_key = os.path.join(self.dir.name, "work", "fabric_config", "fabric_bastion_key")
        self.assertIn(f"ProxyCommand=ssh -i {bastion_key} -W [%h]:%p carol_0003@bastion.fabric-testbed.net",
                      record["tunnel_without_ssh_config"])

    def test_delete_drains_every_worker_before_the_slice_goes(self):
        r = self.run_with_status([self.worker("utah-0", "utah", "Quadro RTX 6000"),
                                  self.worker("star-0", "star", "Tesla T4", "Tesla T4")])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = run_script(["--slice", "gt-real", "--delete", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        lines = r.stdout.splitlines()
        delete = next(i for i, line in enumerate(lines) if "slice[gt-real].delete()" in line)
        for node in ("utah-0", "star-0"):
            drain = next(i for i, line in enumerate(lines) if line.startswith(f"[{node}] $ ") and "worker drain" in line)
            self.assertLess(drain, delete)
            self.assertIn('env GEOTRAIN_HEAD=10.128.1.2:6380 GEOTRAIN_TOKEN_FILE=/etc/geotrain/token geotrain worker '
                          'drain "$(hostname)" --wait', lines[drain])
            self.assertTrue(lines[drain].endswith("&& sudo systemctl stop geotrain-worker"), lines[drain])
        # Without the deployment's record the slice still goes, undrained, and the script says so.
        r = run_script(["--slice", "gt-other", "--delete", "--dry-run"], self.dir.name)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("the workers are not drained first", r.stdout)
        self.assertIn("slice[gt-other].delete()", r.stdout)

    def test_tls_files_are_private_and_an_earlier_runs_are_kept(self):
        workers = [self.worker("utah-0", "utah", "Quadro RTX 6000"),
                   self.worker("star-0", "star", "Tesla T4", "Tesla T4")]
        secrets_dir = os.path.join(self.dir.name, ".geotrain", "gt-real")
        tls_dir = os.path.join(secrets_dir, "tls")
        first = self.run_with_status(workers, "--tls")
        self.assertEqual(first.returncode, 0, first.stdout + first.stderr)
        self.assertEqual(stat.S_IMODE(os.stat(tls_dir).st_mode), 0o700)
        names = sorted(os.listdir(tls_dir))
        self.assertEqual(names, ["ca.key", "ca.pem", "client.key", "client.pem", "server.key", "server.pem"])
        for name in names:
            self.assertEqual(stat.S_IMODE(os.stat(os.path.join(tls_dir, name)).st_mode), 0o600, name)
        with open(os.path.join(tls_dir, "ca.pem")) as f:
            first_ca = f.read()
        with open(os.path.join(secrets_dir, "cluster.json")) as f:
            self.assertEqual(json.load(f)["tls_ca"], os.path.join(tls_dir, "ca.pem"))
        second = self.run_with_status(workers, "--tls")
        self.assertEqual(second.returncode, 0, second.stdout + second.stderr)
        kept = [d for d in os.listdir(secrets_dir) if d.startswith("tls-")]
        self.assertEqual(len(kept), 1, os.listdir(secrets_dir))
        with open(os.path.join(secrets_dir, kept[0], "ca.pem")) as f:
            self.assertEqual(f.read(), first_ca)

    def test_gpus_other_than_planned_are_reported(self):
        r = self.run_with_status([self.worker("utah-0", "utah", "cpu x16", kind="DEVICE_KIND_CPU"),
                                  self.worker("star-0", "star", "Tesla T4", "Tesla T4")])
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertIn("the head's view differs from the plan:\n  site utah: the workers registered 0 GPUs, the plan "
                      "has 1 x RTX6000", r.stdout)


class HeadViewTest(unittest.TestCase):
    """The last step of a real run: `geotrain status --json` from the head against the plan."""

    @classmethod
    def setUpClass(cls):
        cls.fabric = load_script()
        cls.sites = [cls.fabric.Site("UTAH", "RTX6000", "GPU_RTX6000", 2, 1),
                     cls.fabric.Site("STAR", "T4", "GPU_TeslaT4", 1, 2)]

    @staticmethod
    def worker(worker_id, site, *names, kind="DEVICE_KIND_CUDA", state="WORKER_ALIVE"):
        return {"worker_id": worker_id, "site": site, "state": state,
                "devices": [{"index": i, "kind": kind, "name": n, "memory_bytes": str(24 << 30)}
                            for i, n in enumerate(names)]}

    def test_gpu_names_map_to_fabric_components(self):
        for given, expected in {"RTX6000": ("RTX6000", "GPU_RTX6000"), "Quadro RTX 6000": ("RTX6000", "GPU_RTX6000"),
                                "t4": ("T4", "GPU_TeslaT4"), "GPU_TeslaT4": ("T4", "GPU_TeslaT4"),
                                "A30": ("A30", "GPU_A30"), "GPU_A40": ("A40", "GPU_A40"),
                                "GPU_Future9": ("FUTURE9", "GPU_Future9"), "GPU_A100": ("A100", "GPU_A100")}.items():
            self.assertEqual(self.fabric.fabric_gpu(given), expected, given)
        for missing in ("A100", "H100", "L4", "L40S", "A10"):
            with self.assertRaisesRegex(ValueError, f"FABRIC has no {missing} GPU"):
                self.fabric.fabric_gpu(missing)

    def test_what_the_plan_asked_for_is_no_problem(self):
        status = {"workers": [self.worker("utah-0", "utah", "Quadro RTX 6000"),
                              self.worker("utah-1", "utah", "Quadro RTX 6000"),
                              self.worker("star-0", "star", "Tesla T4", "Tesla T4")]}
        view, problems = self.fabric.head_view(self.sites, status)
        self.assertEqual(problems, [])
        self.assertEqual(view, ["  site utah: 2 alive workers, 2 GPUs: 2 x Quadro RTX 6000 (24.0 GiB)",
                                "  site star: 1 alive workers, 2 GPUs: 2 x Tesla T4 (24.0 GiB)"])

    def test_differences_from_the_plan_are_named(self):
        status = {"workers": [self.worker("utah-0", "utah", "cpu x16", kind="DEVICE_KIND_CPU"),
                              self.worker("utah-1", "utah", "NVIDIA A30"),
                              self.worker("star-0", "star", "Tesla T4", "Tesla T4", state="WORKER_DEAD"),
                              self.worker("odd-0", "odd", "Tesla T4")]}
        _, problems = self.fabric.head_view(self.sites, status)
        text = "\n".join(problems)
        self.assertIn("site utah: the workers registered 1 GPUs, the plan has 2 x RTX6000", text)
        self.assertIn("site utah: FABRIC gave NVIDIA A30 where the plan says RTX6000", text)
        self.assertIn("site star: 0 alive workers, the plan has 1 nodes", text)
        self.assertIn("worker odd-0 registered site 'odd', which is not in the plan", text)

    def test_the_study_notebook_describes_sites_the_same_way(self):
        notebook = os.path.join(os.path.dirname(os.path.abspath(SCRIPT)), "geotrain_study.ipynb")
        with open(notebook) as f:
            cells = json.load(f)["cells"]
        parameters = "".join(next(c for c in cells if "parameters" in c["metadata"].get("tags", []))["source"])
        sites = next(ast.literal_eval(node.value) for node in ast.parse(parameters).body
                     if isinstance(node, ast.Assign) and node.targets[0].id == "SITES")
        self.assertGreater(len(sites), 1)
        for text in sites:
            self.fabric.parse_site(text)  # raises on a description the script would refuse
        fabric_cells = "".join("".join(c["source"]) for c in cells if "fabric" in c["metadata"].get("tags", []))
        self.assertIn('("--site", site)', fabric_cells)
        self.assertIn('argv = cluster["tunnel"]', fabric_cells)  # the tunnel the script wrote to cluster.json
        self.assertIn("subprocess.Popen(argv)", fabric_cells)

    def test_a_gpu_name_matches_whole_words_only(self):
        self.assertTrue(self.fabric.detected_matches("A100", "NVIDIA A100-SXM4-80GB".replace("-", " ")))
        self.assertFalse(self.fabric.detected_matches("A10", "NVIDIA A100"))
        self.assertTrue(self.fabric.detected_matches("RTX6000", "Quadro RTX 6000"))
        self.assertTrue(self.fabric.detected_matches("FUTURE9", "NVIDIA Future9"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
