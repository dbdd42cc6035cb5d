#!/usr/bin/env python3
"""A geotrain cluster on FABRIC (https://fabric-testbed.net), with FABRIC's Python API (fablib).

Creates a slice described site by site (each site its own GPU model, node count and GPUs per node; one FABNetv4
network per site, routed between sites), installs the geotrain .deb on every node, writes /etc/geotrain (token
file, env files, optionally TLS certificates), opens the ports, starts the head (first node of the first site)
and a worker on every node under systemd, and starts Prometheus on the head's node with the head's file-based
discovery. docs/deploy.md explains each step.

    # build the package on Debian 12 first: make build && (cd build && cpack -G DEB)
    deploy/fabric/geotrain_fabric.py --slice geotrain \\
        --site UTAH:RTX6000:2 --site TACC:A30:1 --site STAR:T4:2:2 \\
        --deb build/geotrain_0.1.0_amd64.deb [--tls] [--dry-run]
    deploy/fabric/geotrain_fabric.py --slice geotrain --delete   # drains every worker first, then deletes

--site NAME:GPU_MODEL:NODES[:GPUS_PER_NODE] describes one site (repeat it; the head runs on the first site's
first node). GPU_MODEL is geotrain's name of the GPU (RTX6000, T4, A30, A40) or fablib's component name
(GPU_RTX6000, GPU_TeslaT4, ...). `--sites UTAH,STAR --nodes-per-site 2 --gpu RTX6000 [--gpus-per-node N]`
is the shorthand for sites that are all alike. What the cluster has is not taken from this description: every
worker detects its GPUs when it starts (name, memory and compute capability, through CUDA) and registers them with
the head; the script prints the head's view at the end and says where it differs from the plan.

Secrets stay in --secrets-dir (default ~/.geotrain/SLICE/, mode 0700, files 0600): the cluster token (made once,
reused by later runs), the TLS CA and certificates (--tls), and cluster.json (the head's address and the SSH
tunnel, for the study notebook). Nothing there is ever deleted. The cluster token goes to the nodes as a file
(mode 0600) and is never put on a command line: not here, not on the nodes (the units read GEOTRAIN_TOKEN_FILE).
At the end the script prints the SSH tunnel command (slice key, FABRIC bastion, ports) that brings the head's API
(6380), its /metrics (9470) and Prometheus (9090) to this machine.

--delete first drains every worker (`geotrain worker drain ID --wait` on its node: the jobs it hosts restart without
it from a checkpoint at a step boundary, nothing lost), stops its service, then deletes the slice; it reads the head's
address and the sites from the secrets dir's cluster.json (without it, the slice is deleted undrained).

--dry-run prints every step (each fablib call, each remote command and each file written, in order) and runs
none of them; it needs neither fablib nor FABRIC credentials nor the .deb (it says it would upload it), and only
creates the secrets directory and the token. Exit status: 0 when the head sees what the plan asked for, 3 when
the cluster is up but the head's view differs from the plan (printed), 1 on a failed step, 2 on a bad argument.
fablib (pip install fabrictestbed-extensions) is imported only for a real run, which also needs the usual
fablib configuration (~/work/fabric_config/fabric_rc, or FABRIC_* variables).
"""
import argparse
import ipaddress
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The fixed ports of docs/deploy.md ("Firewall ports"), the systemd units' defaults and deploy/open-ports.sh's
# examples: a firewall rule or an SSH tunnel written once stays right.
HEAD_PORT = 6380
HEAD_METRICS_PORT = 9470
WORKER_PORT = 6381
WORKER_METRICS_PORT = 9471
PROMETHEUS_PORT = 9090
# FABNetv4: every site's network is a subnet of this range, routed through the site's gateway.
FABNET_V4 = ipaddress.ip_network("10.128.0.0/10")
SHARE = "/usr/share/geotrain"

# FABRIC's GPU components (fablib's Node.add_component models) by geotrain's name of the GPU, the name topologies
# and --emulate-device use (common/spec.cc's known devices). NVIDIA's names ("Quadro RTX 6000", "Tesla T4") and
# fablib's component names normalise to these keys too.
FABRIC_GPUS = {"RTX6000": "GPU_RTX6000", "T4": "GPU_TeslaT4", "A30": "GPU_A30", "A40": "GPU_A40"}
# GPUs geotrain knows that FABRIC does not offer as a component: named here so that the error says so at once,
# instead of the slice failing at submit.
NOT_ON_FABRIC = ("A10", "A100", "H100", "H200", "L4", "L40S", "V100")
SITE_FORM = "NAME:GPU_MODEL:NODES[:GPUS_PER_NODE], e.g. UTAH:RTX6000:2 or STAR:T4:2:2"
# FABRIC's bastion and fablib's default files (fablib's Constants); FABRIC_* variables and the flags override them.
FABRIC_CONFIG_DIR = "~/work/fabric_config"
DEFAULT_BASTION_HOST = "bastion.fabric-testbed.net"
# Names geotrain itself uses inside ~/.geotrain (GEOTRAIN_HOME): a slice named like one of them needs --secrets-dir.
GEOTRAIN_HOME_ENTRIES = ("head", "worker", "cluster", "current_cluster.json")


class Site(NamedTuple):
    """One site of the slice as --site describes it."""
    name: str           # FABRIC's site name, upper case (UTAH)
    gpu: str            # geotrain's name of the GPU (RTX6000)
    component: str      # fablib's component model (GPU_RTX6000)
    nodes: int
    gpus_per_node: int

    @property
    def label(self):
        """The site's name for geotrain (GEOTRAIN_SITE, node names, networks): lower case."""
        return self.name.lower()


def normalize_gpu_name(name):
    """As common/spec.cc's NormalizeDeviceName: upper case, without spaces, hyphens and underscores."""
    return re.sub(r"[\s_-]", "", name).upper()


def fabric_gpu(model):
    """(geotrain's GPU name, fablib's component) for RTX6000, T4, A30, A40, their NVIDIA names or fablib's
    component names. A component name this script does not know (GPU_...) goes to fablib as it is, so that a GPU
    FABRIC adds later needs no change here. Raises ValueError naming the model and what FABRIC offers."""
    key = normalize_gpu_name(model)
    for prefix in ("GPU", "NVIDIA", "TESLA", "QUADRO"):
        if key.startswith(prefix) and len(key) > len(prefix):
            key = key[len(prefix):]
    offered = ", ".join(f"{gpu} ({component})" for gpu, component in FABRIC_GPUS.items())
    if key in FABRIC_GPUS:
        return key, FABRIC_GPUS[key]
    if re.fullmatch(r"GPU_[A-Za-z0-9_]+", model):
        return key, model
    if key in NOT_ON_FABRIC:
        raise ValueError(f"FABRIC has no {key} GPU to add to a node; its GPUs are {offered} (should your FABRIC "
                         f"offer one, name its fablib component, e.g. GPU_{key})")
    raise ValueError(f"unknown GPU model {model!r}; FABRIC's GPUs are {offered} "
                     "(or name a fablib component as GPU_...)")


def parse_site(text):
    """--site NAME:GPU_MODEL:NODES[:GPUS_PER_NODE] as a Site; argparse prints the error with the flag's name."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"{text!r} has {len(parts)} part(s); expected {SITE_FORM}")
    name, model, nodes = parts[0].strip(), parts[1].strip(), parts[2].strip()
    gpus_per_node = parts[3].strip() if len(parts) == 4 else "1"
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", name):
        raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not a FABRIC site name (letters and digits, "
                                         f"e.g. UTAH, TACC, STAR); expected {SITE_FORM}")
    try:
        gpu, component = fabric_gpu(model)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    counts = []
    for what, value in (("NODES", nodes), ("GPUS_PER_NODE", gpus_per_node)):
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} {value!r} is not a whole number of at least 1; "
                                             f"expected {SITE_FORM}")
        counts.append(int(value))
    return Site(name.upper(), gpu, component, counts[0], counts[1])


def log(line=""):
    print(line, flush=True)


# ---- dry run: stand-ins for fablib's objects that print each call ----

def _args_text(args, kwargs):
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return ", ".join(parts)


class _DryRunObject:
    """Prints each fablib call made on it as `fablib: <label>.<method>(<arguments>)`, except execute and
    upload_file, which remote() and upload() log in both modes as `[node] $ command` and `[node] upload`."""

    def __init__(self, label):
        self._label = label

    def _call(self, method, *args, result=None, **kwargs):
        shown = f" -> {result}" if result is not None else ""
        log(f"fablib: {self._label}.{method}({_args_text(args, kwargs)}){shown}")


class DryRunInterface(_DryRunObject):
    def ip_addr_add(self, addr, subnet):
        self._call("ip_addr_add", addr=str(addr), subnet=str(subnet))


class DryRunComponent(_DryRunObject):
    def __init__(self, label):
        super().__init__(label)
        self._interface = DryRunInterface(f"{label}.interface[0]")

    def get_interfaces(self):
        self._call("get_interfaces")
        return [self._interface]


class DryRunNode(_DryRunObject):
    def __init__(self, name):
        super().__init__(f"node[{name}]")
        self.name = name
        self._components = {}

    def add_component(self, model, name):
        self._call("add_component", model=model, name=name)
        self._components[name] = DryRunComponent(f"{self._label}.{name}")
        return self._components[name]

    def get_interface(self, network_name):
        self._call("get_interface", network_name=network_name)
        return self._components["nic0"]._interface

    def ip_route_add(self, subnet, gateway):
        self._call("ip_route_add", subnet=str(subnet), gateway=str(gateway))

    def upload_file(self, local_file_path, remote_file_path):
        pass

    def execute(self, command, quiet=False):
        return f"{EXIT_MARK}0\n", ""

    def get_management_ip(self):
        ip = f"<management IP of {self.name}>"
        self._call("get_management_ip", result=ip)
        return ip

    def get_username(self):
        # The login user of the node's image (default_debian_12's is debian); fablib reads it from the sliver.
        self._call("get_username", result="debian")
        return "debian"


class DryRunNetwork(_DryRunObject):
    """A site's FABNetv4 network; the dry run numbers site k's subnet 10.128.k.0/24 (FABRIC assigns real ones)."""

    def __init__(self, name, index):
        super().__init__(f"network[{name}]")
        self._subnet = ipaddress.ip_network(f"10.128.{index + 1}.0/24")

    def get_subnet(self):
        self._call("get_subnet", result=str(self._subnet))
        return self._subnet

    def get_gateway(self):
        gateway = self._subnet.network_address + 1
        self._call("get_gateway", result=str(gateway))
        return gateway

    def get_available_ips(self):
        ips = [self._subnet.network_address + i for i in range(2, 12)]
        self._call("get_available_ips", result=f"[{ips[0]} ... {ips[-1]}]")
        return ips


class DryRunSlice(_DryRunObject):
    def __init__(self, name):
        super().__init__(f"slice[{name}]")
        self._nodes, self._networks = {}, {}

    def add_node(self, name, site, cores, ram, disk, image):
        self._call("add_node", name=name, site=site, cores=cores, ram=ram, disk=disk, image=image)
        self._nodes[name] = DryRunNode(name)
        return self._nodes[name]

    def add_l3network(self, name, interfaces, type):
        self._call("add_l3network", name=name, interfaces=f"<{len(interfaces)} interfaces>", type=type)
        self._networks[name] = DryRunNetwork(name, len(self._networks))
        return self._networks[name]

    def submit(self):
        self._call("submit")

    def get_node(self, name):
        self._call("get_node", name=name)
        if name not in self._nodes:  # a slice got by name (--delete): its nodes as the record names them
            self._nodes[name] = DryRunNode(name)
        return self._nodes[name]

    def get_network(self, name):
        self._call("get_network", name=name)
        return self._networks[name]

    def delete(self):
        self._call("delete")


class DryRunFablib(_DryRunObject):
    def __init__(self):
        super().__init__("fablib")
        log("fablib: FablibManager()")

    def new_slice(self, name):
        self._call("new_slice", name=name)
        return DryRunSlice(name)

    def get_slice(self, name):
        self._call("get_slice", name=name)
        return DryRunSlice(name)


def real_fablib():
    try:
        from fabrictestbed_extensions.fablib.fablib import FablibManager  # noqa: PLC0415 (lazy: not installable here)
    except ImportError:
        sys.exit("geotrain_fabric.py: fablib is not installed; run `pip install fabrictestbed-extensions` "
                 "(and configure it: https://learn.fabric-testbed.net), or pass --dry-run to see the steps")
    return FablibManager()


# ---- what runs on the nodes ----

EXIT_MARK = "geotrain-fabric-exit="


def remote(node, name, command):
    """Runs a shell command on a node and returns its output; stops the deployment, with the command's
    output, when it fails (fablib's execute returns output, not the exit status: a marker line carries it)."""
    log(f"[{name}] $ {command}")
    stdout, stderr = node.execute(f"{command}; echo {EXIT_MARK}$?", quiet=True)
    lines = stdout.rstrip("\n").split("\n")
    if not lines or not lines[-1].startswith(EXIT_MARK) or lines[-1] != f"{EXIT_MARK}0":
        sys.exit(f"geotrain_fabric.py: on {name}, `{command}` failed:\n{stdout}{stderr}")
    return "\n".join(lines[:-1])


def upload(node, name, local_path, remote_path, shown=None):
    """Copies a file to the node (as the login user); `shown` is what the log says about its contents."""
    log(f"[{name}] upload {shown or local_path} -> {remote_path}")
    node.upload_file(local_path, remote_path)


def install_file(node, name, local_path, dest, mode, owner="root", shown=None, show_text=False):
    """Copies a local file to `dest` on the node with the given mode and owner (through a file in the login
    user's home, removed after). With show_text the contents are logged (env files; never the token)."""
    staged = os.path.basename(dest) + ".upload"
    upload(node, name, local_path, staged, shown=shown or os.path.basename(local_path))
    if show_text:
        with open(local_path) as f:
            for line in f.read().splitlines():
                log(f"    {line}")
    remote(node, name, f"sudo install -D -m {mode} -o {owner} -g {owner} {staged} {dest} && rm -f {staged}")


def open_ports_command(source, ports=()):
    """Lets TCP `ports` (none: every port) in from `source` through the node's firewall, if one is active."""
    return " ".join(["sudo", f"{SHARE}/open-ports.sh", source] + [str(p) for p in ports])


def env_text(values):
    return "".join(f"{k}={v}\n" for k, v in values.items())


def write_local(directory, filename, text, mode=0o644):
    path = os.path.join(directory, filename)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def enable_service(node, name, unit):
    remote(node, name, f"sudo install -m 0644 {SHARE}/systemd/{unit}.service /etc/systemd/system/ && "
                       f"sudo systemctl daemon-reload && sudo systemctl enable --now {unit}")
    # Restart=on-failure would hide a unit that keeps failing: wait until it stays up.
    remote(node, name, f"sleep 3 && systemctl is-active --quiet {unit} || "
                       f"(sudo journalctl -u {unit} -n 30 --no-pager; exit 1)")


# ---- the secrets directory: token, TLS files, the cluster's record ----

def check_private(path, what):
    """Stops when `path` can be read by others: a token or key there would not be a secret."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        sys.exit(f"geotrain_fabric.py: {what} {path} is open to other users (mode {mode:04o}); "
                 f"run `chmod {'700' if os.path.isdir(path) else '600'} {shlex.quote(path)}`, or name another "
                 "--secrets-dir")


def prepare_secrets_dir(path):
    """Creates the secrets directory (mode 0700, and its parents such as ~/.geotrain the same way geotrain makes
    its home) or checks that an existing one is private. It outlives the run: the user needs the token and the CA
    to talk to the cluster, and a later run reuses them."""
    if os.path.exists(path) and not os.path.isdir(path):
        sys.exit(f"geotrain_fabric.py: --secrets-dir {path} is a file, not a directory; name a directory")
    if os.path.isdir(path):
        check_private(path, "the secrets directory")
    else:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask left
    log(f"local: secrets directory {path} (mode 0700; kept, never deleted)")
    return path


def write_private(path, text):
    """Writes a file only its owner can read: 0600 from the moment it is created (an older file of that name is
    made 0600 too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def cluster_token_file(args, secrets_dir):
    """The token file the nodes get: --token-file, else the secrets directory's token, made on the first run
    and reused after, so that re-running the script (or the notebook) keeps the token the user already has."""
    if args.token_file:
        log(f"local: cluster token from {args.token_file} (--token-file)")
        return args.token_file
    path = os.path.join(secrets_dir, "token")
    if os.path.exists(path):
        check_private(path, "the token file")
        with open(path) as f:
            if not f.read().strip():
                sys.exit(f"geotrain_fabric.py: the token file {path} is empty; remove it to make a new token, or "
                         "pass --token-file")
        log(f"local: reusing the cluster token in {path} (mode 0600)")
        return path
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    log(f"local: new cluster token in {path} (mode 0600)")
    return path


def make_certificates(args, secrets_dir, addresses):
    """TLS files for every node's address into <secrets>/tls (deploy/make-certs.sh). Certificates made by an
    earlier run name that run's addresses: they move to tls-<time>/ instead of being overwritten."""
    tls_dir = os.path.join(secrets_dir, "tls")
    command = ["bash", os.path.join(REPO, "deploy", "make-certs.sh"), tls_dir] + addresses
    if os.path.isdir(tls_dir) and os.listdir(tls_dir):
        base = os.path.join(secrets_dir, time.strftime("tls-%Y%m%d-%H%M%S"))
        kept, n = base, 1
        while os.path.exists(kept):  # two runs within a second
            kept, n = f"{base}.{n}", n + 1
        log(f"local: {'(dry run) a real run moves ' if args.dry_run else ''}the previous certificates in {tls_dir} "
            f"to {kept} (kept)")
        if not args.dry_run:
            os.rename(tls_dir, kept)
    log(f"local: {shlex.join(command)}")
    if not args.dry_run:
        subprocess.run(command, check=True)
        os.chmod(tls_dir, 0o700)
        for filename in os.listdir(tls_dir):
            os.chmod(os.path.join(tls_dir, filename), 0o600)
        log(f"local: CA and certificates in {tls_dir} (files 0600): ca.pem, server.pem/server.key, "
            "client.pem/client.key")
    return tls_dir


# ---- the SSH tunnel to the head ----

class SshSettings(NamedTuple):
    slice_key: str
    ssh_config: str
    bastion_host: str
    bastion_user: str
    bastion_key: str


def fablib_setting(fablib, *getters):
    """A value from fablib's configuration (its getters differ between releases); None when it has none."""
    for getter in getters:
        method = getattr(fablib, getter, None)
        if callable(method):
            try:
                value = method()
            except Exception:  # noqa: BLE001 (a release whose getter needs what this one lacks)
                continue
            if value:
                return value
    return None


def ssh_settings(args, fablib):
    """The slice key, fablib's SSH configuration and the bastion: the flags, else FABRIC_* variables, else (real
    runs) fablib's configuration, else fablib's defaults."""
    env = os.environ.get

    def configured(*getters):  # the dry run's stand-in has no configuration to read
        return None if args.dry_run else fablib_setting(fablib, *getters)

    return SshSettings(
        slice_key=os.path.expanduser(args.slice_key or env("FABRIC_SLICE_PRIVATE_KEY_FILE")
                                     or configured("get_default_slice_private_key_file")
                                     or f"{FABRIC_CONFIG_DIR}/slice_key"),
        ssh_config=os.path.expanduser(args.ssh_config or env("FABRIC_BASTION_SSH_CONFIG_FILE")
                                      or f"{FABRIC_CONFIG_DIR}/ssh_config"),
        bastion_host=args.bastion_host or env("FABRIC_BASTION_HOST") or DEFAULT_BASTION_HOST,
        bastion_user=(args.bastion_user or env("FABRIC_BASTION_USERNAME") or configured("get_bastion_username")
                      or "BASTION_USER"),
        bastion_key=os.path.expanduser(args.bastion_key or env("FABRIC_BASTION_KEY_LOCATION")
                                       or configured("get_bastion_key_location", "get_bastion_key_filename")
                                       or f"{FABRIC_CONFIG_DIR}/fabric_bastion_key"))


def tunnel_forwards(head_ip, prometheus):
    """-L arguments: the head's gRPC API and its /metrics (which listens on the advertised FABNetv4 address, not
    on 127.0.0.1), and Prometheus on the head's node; the same port numbers on this machine."""
    forwards = ["-L", f"{HEAD_PORT}:{head_ip}:{HEAD_PORT}", "-L", f"{HEAD_METRICS_PORT}:{head_ip}:{HEAD_METRICS_PORT}"]
    if prometheus:
        forwards += ["-L", f"{PROMETHEUS_PORT}:127.0.0.1:{PROMETHEUS_PORT}"]
    return forwards


def tunnel_commands(ssh, user, management_ip, head_ip, prometheus):
    """Two equivalent tunnels to the head's node: through fablib's ssh_config (which names the bastion, its user
    and its key, and turns off host-key prompts for the slice's fresh nodes) and, for a machine without that
    file, with the bastion spelled out in a ProxyCommand ([%h] keeps an IPv6 management address whole)."""
    tail = ["-N", "-o", "ExitOnForwardFailure=yes"] + tunnel_forwards(head_ip, prometheus) + [f"{user}@{management_ip}"]
    with_config = ["ssh", "-i", ssh.slice_key, "-F", ssh.ssh_config] + tail
    proxy = f"ssh -i {shlex.quote(ssh.bastion_key)} -W [%h]:%p {ssh.bastion_user}@{ssh.bastion_host}"
    explicit = ["ssh", "-i", ssh.slice_key, "-o", f"ProxyCommand={proxy}",
                "-o", "StrictHostKeyChecking=accept-new"] + tail
    return with_config, explicit


# ---- the head's view: what the workers registered ----

def detected_matches(gpu, device_name):
    """Whether a name CUDA reports ("Quadro RTX 6000", "Tesla T4", "NVIDIA A30") is the GPU the plan names: a run
    of whole words equal to it once normalised (so A10 is not found in "NVIDIA A100")."""
    words = [normalize_gpu_name(w) for w in device_name.split()]
    gpu = normalize_gpu_name(gpu)
    return any("".join(words[i:j]) == gpu for i in range(len(words)) for j in range(i + 1, len(words) + 1))


def head_view(sites, status):
    """(lines describing what each site's alive workers registered, lines saying where that differs from the
    plan). `status` is `geotrain status --json`: each worker's devices are the ones it detected at start (name,
    memory, compute capability)."""
    alive = [w for w in status.get("workers", []) if w.get("state") == "WORKER_ALIVE"]
    view, problems = [], []
    for site in sites:
        workers = [w for w in alive if w.get("site") == site.label]
        devices = [d for w in workers for d in w.get("devices", [])]
        gpus = [d for d in devices if d.get("kind") == "DEVICE_KIND_CUDA"]
        described = {}
        for d in devices:
            # compute_capability is major * 10 + minor from the CUDA runtime; 0 or absent for a CPU.
            capability = int(d.get("compute_capability", 0) or 0)
            key = (f"{d.get('name', '?')} ({int(d.get('memory_bytes', 0)) / 2**30:.1f} GiB"
                   + (f", compute capability {capability // 10}.{capability % 10}" if capability else "") + ")")
            described[key] = described.get(key, 0) + 1
        view.append(f"  site {site.label}: {len(workers)} alive workers, {len(gpus)} GPUs: "
                    + (", ".join(f"{n} x {k}" for k, n in described.items()) or "no devices"))
        if len(workers) != site.nodes:
            problems.append(f"site {site.label}: {len(workers)} alive workers, the plan has {site.nodes} nodes "
                            f"(`systemctl status geotrain-worker` on the missing ones)")
        expected = site.nodes * site.gpus_per_node
        if len(gpus) != expected:
            problems.append(f"site {site.label}: the workers registered {len(gpus)} GPUs, the plan has {expected} "
                            f"x {site.gpu}; a worker that finds no GPU offers the CPU: the NVIDIA driver and CUDA "
                            "runtime (--node-setup) or a .deb built with CUDA are missing")
        other = sorted({d.get("name", "?") for d in gpus if not detected_matches(site.gpu, d.get("name", ""))})
        if other:
            problems.append(f"site {site.label}: FABRIC gave {', '.join(other)} where the plan says {site.gpu}")
    planned = {site.label for site in sites}
    for worker in alive:
        if worker.get("site") not in planned:
            problems.append(f"worker {worker.get('worker_id')} registered site {worker.get('site')!r}, "
                            "which is not in the plan")
    return view, problems


def check_head_view(head, head_name, cli, cli_tls, sites, dry_run):
    """Waits (up to a minute) until every planned node's worker has registered, prints what the workers
    registered and returns where it differs from the plan."""
    command = f"{cli} status --json{cli_tls}"
    if dry_run:
        remote(head, head_name, command)
        log("(dry run: here the script prints what each worker registered, the GPUs it detected at start, "
            "and where that differs from the plan)")
        return []
    expected_workers = sum(site.nodes for site in sites)
    for attempt in range(12):
        answer = remote(head, head_name, command)
        try:
            status = json.loads(answer)
        except json.JSONDecodeError as e:
            sys.exit(f"geotrain_fabric.py: `geotrain status --json` on {head_name} did not print JSON ({e}):\n{answer}")
        alive = [w for w in status.get("workers", []) if w.get("state") == "WORKER_ALIVE"]
        if len(alive) >= expected_workers or attempt == 11:
            break
        time.sleep(5)
    view, problems = head_view(sites, status)
    log("the head's view (each worker's devices as it detected them at start, not as planned):")
    for line in view:
        log(line)
    return problems


# ---- the deployment ----

def plan_nodes(sites):
    """[(site label, node name)] in order; the first node of the first site runs the head."""
    return [(site.label, f"{site.label}-{i}") for site in sites for i in range(site.nodes)]


def print_plan(args, sites):
    gpus = sum(site.nodes * site.gpus_per_node for site in sites)
    log(f"== plan: {len(sites)} sites, {sum(site.nodes for site in sites)} nodes, {gpus} GPUs; the head on "
        f"{sites[0].label}-0 (ports {HEAD_PORT}, metrics {HEAD_METRICS_PORT}), a worker on every node "
        f"(ports {WORKER_PORT}, metrics {WORKER_METRICS_PORT})")
    for site in sites:
        names = ", ".join(f"{site.label}-{i}" for i in range(site.nodes))
        log(f"  site {site.name}: {site.nodes} node{'s' if site.nodes > 1 else ''} x {site.gpus_per_node} "
            f"{site.gpu} ({site.component}): {names}")
        if site.gpu not in FABRIC_GPUS:
            log(f"    {site.component} is not a FABRIC GPU this script knows ({', '.join(FABRIC_GPUS.values())}); "
                "it goes to fablib as it is")
    log("  the workers register the GPUs they detect at start (no --emulate-device): the head's view is what "
        "the nodes have")


def create_slice(fablib, args, sites, nodes):
    log(f"== creating slice {args.slice}: " + ", ".join(
        f"{site.name} {site.nodes} x {site.gpus_per_node} {site.component}" for site in sites))
    slice_ = fablib.new_slice(name=args.slice)
    by_label = {site.label: site for site in sites}
    interfaces = {site.label: [] for site in sites}
    for label, name in nodes:
        site = by_label[label]
        node = slice_.add_node(name=name, site=site.name, cores=args.cores, ram=args.ram, disk=args.disk,
                               image=args.image)
        for g in range(site.gpus_per_node):
            node.add_component(model=site.component, name=f"gpu{g}")
        interfaces[label].append(node.add_component(model="NIC_Basic", name="nic0").get_interfaces()[0])
    for site in sites:
        slice_.add_l3network(name=f"fabnet-{site.label}", interfaces=interfaces[site.label], type="IPv4")
    slice_.submit()
    return slice_


def configure_network(slice_, sites, nodes):
    """Addresses each node on its site's FABNetv4 network and routes the other sites through its gateway."""
    log("== addressing the nodes on FABNetv4")
    addresses, subnets = {}, {}
    for site in sites:
        network_name = f"fabnet-{site.label}"
        network = slice_.get_network(name=network_name)
        subnet, gateway = network.get_subnet(), network.get_gateway()
        subnets[site.label] = subnet
        available = iter(network.get_available_ips())
        for node_site, name in nodes:
            if node_site != site.label:
                continue
            node = slice_.get_node(name=name)
            address = next(available)
            node.get_interface(network_name=network_name).ip_addr_add(addr=address, subnet=subnet)
            node.ip_route_add(subnet=FABNET_V4, gateway=gateway)
            addresses[name] = str(address)
    return addresses, subnets


def deploy(slice_, fablib, args, sites, nodes, addresses, subnets, token_path, secrets_dir, workdir):
    """Installs and starts everything; returns where the head's view differs from the plan."""
    head_site, head_name = nodes[0]
    head_ip = addresses[head_name]
    head_address = f"{head_ip}:{HEAD_PORT}"
    tls_dir = make_certificates(args, secrets_dir, [addresses[n] for _, n in nodes]) if args.tls else None
    tls_env = {}
    if tls_dir:
        tls_env = {"GEOTRAIN_TLS_CERT": "/etc/geotrain/tls/server.pem",
                   "GEOTRAIN_TLS_KEY": "/etc/geotrain/tls/server.key", "GEOTRAIN_TLS_CA": "/etc/geotrain/tls/ca.pem"}
    deb_shown = args.deb
    if not (args.deb and os.path.isfile(args.deb)):  # only a dry run gets here without the package
        deb_shown = f"{args.deb or '<the .deb, --deb>'} (dry run: not built yet)"

    for site, name in nodes:
        node = slice_.get_node(name=name)
        is_head = name == head_name
        log(f"== {name} ({site}, {addresses[name]}){' : head and worker' if is_head else ' : worker'}")
        if args.node_setup:
            upload(node, name, args.node_setup, "geotrain-node-setup.sh")
            remote(node, name, "sudo bash geotrain-node-setup.sh")
        upload(node, name, args.deb, "geotrain.deb", shown=deb_shown)
        remote(node, name, "sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive "
                           "apt-get install -y -q ./geotrain.deb && rm -f geotrain.deb")
        install_file(node, name, token_path, "/etc/geotrain/token", "0600", owner="geotrain",
                     shown="<the cluster token file>")
        if tls_dir:
            for filename, mode in (("ca.pem", "0644"), ("server.pem", "0644"), ("server.key", "0600")):
                install_file(node, name, os.path.join(tls_dir, filename), f"/etc/geotrain/tls/{filename}", mode,
                             owner="geotrain")
        # Fixed ports (the unit's defaults, written out so the file says what the firewall opens) and no
        # GEOTRAIN_WORKER_ARGS: no --emulate-device, the worker offers the GPUs it finds.
        worker_env = {"GEOTRAIN_HEAD": head_address, "GEOTRAIN_SITE": site,
                      "GEOTRAIN_TOKEN_FILE": "/etc/geotrain/token",
                      "GEOTRAIN_ADVERTISE_ADDRESS": f"{addresses[name]}:{WORKER_PORT}",
                      "GEOTRAIN_WORKER_PORT": WORKER_PORT, "GEOTRAIN_METRICS_PORT": WORKER_METRICS_PORT, **tls_env}
        install_file(node, name, write_local(workdir, f"worker-{name}.env", env_text(worker_env)),
                     "/etc/geotrain/worker.env", "0644", show_text=True)
        ports = [WORKER_PORT, WORKER_METRICS_PORT]
        if is_head:
            head_env = {"GEOTRAIN_TOKEN_FILE": "/etc/geotrain/token", "GEOTRAIN_ADVERTISE_HOST": addresses[name],
                        "GEOTRAIN_HEAD_PORT": HEAD_PORT, "GEOTRAIN_METRICS_PORT": HEAD_METRICS_PORT,
                        "GEOTRAIN_STATE_DIR": "/var/lib/geotrain", **tls_env}
            install_file(node, name, write_local(workdir, "head.env", env_text(head_env)), "/etc/geotrain/head.env",
                         "0644", show_text=True)
            ports = [HEAD_PORT, HEAD_METRICS_PORT, PROMETHEUS_PORT] + ports
        # The cluster's ports to every FABNetv4 address; everything to the node's own site (NCCL picks ports).
        remote(node, name, open_ports_command(str(FABNET_V4), ports))
        remote(node, name, open_ports_command(str(subnets[site])))
        if is_head:
            enable_service(node, name, "geotrain-head")

    log("== starting the workers")
    for site, name in nodes:
        enable_service(slice_.get_node(name=name), name, "geotrain-worker")

    head = slice_.get_node(name=head_name)
    if args.prometheus:
        log(f"== Prometheus on {head_name}: file discovery of the head's targets")
        remote(head, head_name, "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus && "
                                f"sudo install -m 0644 {SHARE}/prometheus/prometheus.yml "
                                f"{SHARE}/prometheus/geotrain-alerts.yml /etc/prometheus/ && "
                                "sudo systemctl restart prometheus")

    log("== the cluster as the head sees it")
    # The CLI as the service user, which can read the token file; the token itself stays in the file.
    cli = f"sudo -u geotrain env GEOTRAIN_HEAD={head_address} GEOTRAIN_TOKEN_FILE=/etc/geotrain/token geotrain"
    cli_tls = " --tls-ca /etc/geotrain/tls/ca.pem" if tls_dir else ""
    problems = check_head_view(head, head_name, cli, cli_tls, sites, args.dry_run)
    status = remote(head, head_name, f"{cli} status{cli_tls}")
    if status:
        log(status)

    management_ip = head.get_management_ip()
    user = head.get_username()
    ssh = ssh_settings(args, fablib)
    with_config, explicit = tunnel_commands(ssh, user, management_ip, head_ip, args.prometheus)
    log(f"head: {head_address} on {head_name} ({management_ip}); {len(nodes)} workers in {len(sites)} sites")
    log(f"submit a job on {head_name}: {cli} job submit job.yaml --follow{cli_tls}")
    log(f"== secrets in {secrets_dir} (kept): token {token_path}"
        + (f", CA {tls_dir}/ca.pem, certificates {tls_dir}/" if tls_dir else ""))
    forwarded = f"the API {HEAD_PORT} and /metrics {HEAD_METRICS_PORT}" + (
        f" and Prometheus {PROMETHEUS_PORT}" if args.prometheus else "")
    log(f"== SSH tunnel: {forwarded} of {head_name} to this machine, through the FABRIC bastion "
        f"{ssh.bastion_host} with the slice key {ssh.slice_key}")
    log(f"  {shlex.join(with_config)}")
    if not args.dry_run and not os.path.isfile(ssh.ssh_config):
        log(f"  ({ssh.ssh_config} does not exist here: use the next form, or --ssh-config)")
    log(f"or, without fablib's ssh_config (bastion user {ssh.bastion_user}, bastion key {ssh.bastion_key}):")
    log(f"  {shlex.join(explicit)}")
    if ssh.bastion_user == "BASTION_USER":
        log("  (BASTION_USER: your FABRIC bastion login; --bastion-user or FABRIC_BASTION_USERNAME fills it in)")
    local_tls = f" GEOTRAIN_TLS_CA={shlex.quote(tls_dir + '/ca.pem')}" if tls_dir else ""
    log(f"then, on this machine: GEOTRAIN_HEAD=127.0.0.1:{HEAD_PORT} GEOTRAIN_TOKEN_FILE={shlex.quote(token_path)}"
        f"{local_tls} "
        f"geotrain status; metrics http://127.0.0.1:{HEAD_METRICS_PORT}/metrics"
        + (f"; Prometheus http://127.0.0.1:{PROMETHEUS_PORT}" if args.prometheus else "")
        + f"; Grafana: import {SHARE}/grafana/geotrain-dashboard.json")

    record = {"slice": args.slice, "head": head_address, "head_node": head_name, "management_ip": management_ip,
              "user": user, "token_file": os.path.abspath(token_path),
              "tls_ca": f"{tls_dir}/ca.pem" if tls_dir else "",
              "sites": [site._asdict() for site in sites],
              "ports": {"head": HEAD_PORT, "head_metrics": HEAD_METRICS_PORT, "worker": WORKER_PORT,
                        "worker_metrics": WORKER_METRICS_PORT, "prometheus": PROMETHEUS_PORT},
              "tunnel": with_config, "tunnel_without_ssh_config": explicit}
    record_path = os.path.join(secrets_dir, "cluster.json")
    if args.dry_run:
        log(f"local: (dry run) a real run writes the head's address and the tunnel to {record_path}")
    else:
        write_private(record_path, json.dumps(record, indent=1) + "\n")
        log(f"local: the head's address and the tunnel in {record_path} (the study notebook reads it)")
    return problems


def drain_workers(slice_, secrets_dir):
    """Before the slice goes: each worker drains (its jobs restart without it from a checkpoint at a step boundary,
    nothing lost; `--wait` returns once its actors are gone), then its service stops. The head's address and the
    nodes come from the cluster.json the deployment left in the secrets dir; a worker already gone is said so."""
    record_path = os.path.join(secrets_dir, "cluster.json")
    if not os.path.isfile(record_path):
        log(f"local: no {record_path} (written when the slice was deployed): the workers are not drained first")
        return
    with open(record_path) as f:
        record = json.load(f)
    sites = [Site(**site) for site in record["sites"]]
    cli = f"sudo -u geotrain env GEOTRAIN_HEAD={record['head']} GEOTRAIN_TOKEN_FILE=/etc/geotrain/token geotrain"
    tls = " --tls-ca /etc/geotrain/tls/ca.pem" if record.get("tls_ca") else ""
    log("== draining the workers (their jobs restart without them, nothing lost), then stopping them")
    for _, name in plan_nodes(sites):
        # The unit's worker id is the host name (%H).
        remote(slice_.get_node(name=name), name,
               f'{{ {cli} worker drain "$(hostname)" --wait{tls} || echo "$(hostname): not drained (gone?)"; }} && '
               "sudo systemctl stop geotrain-worker")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slice", required=True, help="slice name")
    p.add_argument("--site", dest="site_specs", action="append", type=parse_site, default=[],
                   metavar="NAME:GPU_MODEL:NODES[:GPUS_PER_NODE]",
                   help="one site (repeat for each; the head runs on the first): FABRIC site, GPU model (RTX6000, "
                        "T4, A30, A40, or a fablib component GPU_...), nodes, GPUs per node (default 1); "
                        "e.g. --site UTAH:RTX6000:2 --site TACC:A30:1 --site STAR:T4:2:2")
    shorthand = p.add_argument_group("shorthand for sites that are all alike (instead of --site)")
    shorthand.add_argument("--sites", type=lambda s: [x.strip().upper() for x in s.split(",") if x.strip()],
                           help="comma-separated FABRIC sites, e.g. UTAH,STAR (the head runs on the first)")
    shorthand.add_argument("--nodes-per-site", type=int, help="GPU nodes per site (default 1)")
    shorthand.add_argument("--gpu", help="GPU model of every node (default RTX6000): RTX6000, T4, A30, A40 or "
                                         "GPU_RTX6000, GPU_TeslaT4, GPU_A30, GPU_A40")
    shorthand.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 1)")
    p.add_argument("--cores", type=int, default=16)
    p.add_argument("--ram", type=int, default=64, help="GB")
    p.add_argument("--disk", type=int, default=100, help="GB")
    p.add_argument("--image", default="default_debian_12", help="node image; the .deb is built for Debian 12")
    p.add_argument("--deb", help="the geotrain .deb to install (cpack -G DEB in the build dir); --dry-run does not "
                                 "need it to exist")
    p.add_argument("--secrets-dir", help="where the token, the TLS CA and certificates and cluster.json are kept "
                                         "(default ~/.geotrain/SLICE; mode 0700, never deleted)")
    p.add_argument("--token-file", help="cluster token file to use (default: the secrets dir's token, made once)")
    p.add_argument("--node-setup", help="a local shell script run as root on every node before the .deb "
                                        "(e.g. the NVIDIA driver and the CUDA runtime for a CUDA build)")
    p.add_argument("--tls", action="store_true", help="make certificates for every node (deploy/make-certs.sh) "
                                                      "into the secrets dir")
    p.add_argument("--no-prometheus", dest="prometheus", action="store_false",
                   help="do not install Prometheus on the head's node")
    tunnel = p.add_argument_group("the SSH tunnel the script prints (defaults: FABRIC_* variables, then fablib's)")
    tunnel.add_argument("--slice-key", help="the slice's private key (FABRIC_SLICE_PRIVATE_KEY_FILE, "
                                            f"{FABRIC_CONFIG_DIR}/slice_key)")
    tunnel.add_argument("--ssh-config", help="fablib's SSH configuration (FABRIC_BASTION_SSH_CONFIG_FILE, "
                                             f"{FABRIC_CONFIG_DIR}/ssh_config)")
    tunnel.add_argument("--bastion-host", help=f"FABRIC's bastion (FABRIC_BASTION_HOST, {DEFAULT_BASTION_HOST})")
    tunnel.add_argument("--bastion-user", help="your bastion login (FABRIC_BASTION_USERNAME)")
    tunnel.add_argument("--bastion-key", help="the bastion's private key (FABRIC_BASTION_KEY_LOCATION, "
                                              f"{FABRIC_CONFIG_DIR}/fabric_bastion_key)")
    p.add_argument("--delete", action="store_true", help="delete the slice and stop (the secrets dir stays)")
    p.add_argument("--dry-run", action="store_true", help="print every step, run nothing (no fablib, no .deb "
                                                          "needed); makes only the secrets dir and the token")
    args = p.parse_args(argv)
    if args.delete:
        return args
    shorthand_given = [f for f, v in (("--sites", args.sites), ("--nodes-per-site", args.nodes_per_site),
                                      ("--gpu", args.gpu), ("--gpus-per-node", args.gpus_per_node)) if v is not None]
    if args.site_specs and shorthand_given:
        p.error(f"--site describes each site in full; drop {', '.join(shorthand_given)} (or describe sites that are "
                "all alike with --sites, --nodes-per-site, --gpu, --gpus-per-node alone)")
    if args.site_specs:
        args.sites_plan = args.site_specs
    elif args.sites:
        for flag, value in (("--nodes-per-site", args.nodes_per_site), ("--gpus-per-node", args.gpus_per_node)):
            if value is not None and value < 1:
                p.error(f"{flag} must be at least 1 (got {value})")
        try:
            gpu, component = fabric_gpu(args.gpu or "RTX6000")
        except ValueError as e:
            p.error(f"--gpu: {e}")
        specs = []
        for name in args.sites:
            if not re.fullmatch(r"[A-Z][A-Z0-9]*", name):
                p.error(f"--sites: {name!r} is not a FABRIC site name (letters and digits, e.g. UTAH,STAR)")
            specs.append(Site(name, gpu, component, args.nodes_per_site or 1, args.gpus_per_node or 1))
        args.sites_plan = specs
    else:
        p.error(f"describe the sites: --site {SITE_FORM.split(', e.g.')[0]} for each (e.g. --site UTAH:RTX6000:2 "
                "--site TACC:A30:1), or --sites UTAH,STAR [--nodes-per-site N] [--gpu MODEL] for sites alike")
    seen = set()
    for site in args.sites_plan:
        if site.label in seen:
            p.error(f"site {site.name} is given twice; describe each site once (NODES counts its nodes)")
        seen.add(site.label)
    if not args.dry_run and (not args.deb or not os.path.isfile(args.deb)):
        p.error(f"--deb: no such package {args.deb!r}; build it with `cd build && cpack -G DEB` "
                "(--dry-run shows the steps without it)")
    if args.token_file and not os.path.isfile(args.token_file):
        p.error(f"--token-file: no such file {args.token_file!r}")
    if args.node_setup and not os.path.isfile(args.node_setup):
        p.error(f"--node-setup: no such file {args.node_setup!r}")
    if not args.secrets_dir and args.slice in GEOTRAIN_HOME_ENTRIES:
        p.error(f"a slice named {args.slice!r} would keep its secrets in ~/.geotrain/{args.slice}, which geotrain "
                "itself uses; pass --secrets-dir DIR")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.slice):
        p.error(f"--slice {args.slice!r}: use letters, digits, '-', '_' and '.' (it names ~/.geotrain/SLICE)")
    args.secrets_dir = os.path.abspath(os.path.expanduser(args.secrets_dir or os.path.join("~/.geotrain", args.slice)))
    return args


def main(argv):
    args = parse_args(argv)
    fablib = DryRunFablib() if args.dry_run else real_fablib()
    if args.delete:
        secrets_dir = os.path.expanduser(args.secrets_dir or os.path.join("~/.geotrain", args.slice))
        slice_ = fablib.get_slice(name=args.slice)
        drain_workers(slice_, secrets_dir)
        slice_.delete()
        log(f"deleted slice {args.slice}; its secrets directory (if any) stays: {secrets_dir}")
        return 0
    sites = args.sites_plan
    nodes = plan_nodes(sites)
    print_plan(args, sites)
    secrets_dir = prepare_secrets_dir(args.secrets_dir)
    token_path = cluster_token_file(args, secrets_dir)
    if args.dry_run and not (args.deb and os.path.isfile(args.deb)):
        log(f"local: (dry run) {args.deb or 'the .deb (--deb)'} does not exist; a real run uploads it to every node")
    # Env files hold no secret: a scratch directory is enough for them.
    with tempfile.TemporaryDirectory(prefix="geotrain-fabric-") as workdir:
        slice_ = create_slice(fablib, args, sites, nodes)
        addresses, subnets = configure_network(slice_, sites, nodes)
        problems = deploy(slice_, fablib, args, sites, nodes, addresses, subnets, token_path, secrets_dir, workdir)
    if problems:
        log("the head's view differs from the plan:")
        for problem in problems:
            log(f"  {problem}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
